//! `zrt launch`: start a job's ranks on this node with the torchrun
//! environment contract.
//!
//! Each rank gets RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE,
//! MASTER_ADDR, MASTER_PORT and ZRT_TOKEN (the job's secret, which the
//! rendezvous store checks). Output lines are prefixed with the rank. The
//! ranks run in their own process group: Ctrl-C reaches the launcher once and
//! is forwarded to every rank. When a rank exits non-zero, the others are
//! stopped (SIGTERM, then SIGKILL after a grace period) and the launcher
//! exits with that rank's code, naming it, unless `--max-restarts` lets it
//! start every rank again (each attempt with a fresh rendezvous and
//! TORCHELASTIC_RESTART_COUNT, as torchrun's). On several nodes the
//! launchers stop, restart and end the job together, see `agents`. Ranks also
//! get the PyTorch wheel's NCCL on LD_LIBRARY_PATH (see `nccl_dir`).

use std::io::{BufRead, BufReader, Write};
use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::process::{Child, Command, ExitCode, Stdio};
use std::sync::atomic::{AtomicI32, Ordering};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use clap::Args;

mod agents;
mod hosts;
use agents::{Agents, Elastic, Failure, Place};

/// Options of `zrt launch`.
#[derive(Args, Debug, Clone)]
pub struct LaunchArgs {
    /// Ranks to start on this node (on every node; with --hostfile, its
    /// slots by default).
    #[arg(long)]
    nproc_per_node: Option<usize>,
    /// Start a job on several nodes from this one: DeepSpeed's hostfile,
    /// one `HOST slots=N` line per node, this machine first. Node k's
    /// launcher is started on host k over ssh (`ZRT_SSH`, `ssh` by
    /// default), in this directory, with this zrt's path.
    #[arg(long, value_name = "FILE", conflicts_with_all = ["nnodes", "node_rank"])]
    hostfile: Option<std::path::PathBuf>,
    /// Nodes in the job: N, or torchrun's MIN:MAX for an elastic job,
    /// which starts with as many nodes as have come (at least MIN),
    /// restarts with nodes that come later, and goes on without nodes
    /// that go (node 0, at MASTER_ADDR, stays).
    #[arg(long, default_value = "1", value_parser = parse_nodes)]
    nnodes: Nodes,
    /// This node's index (0-based); in an elastic job a name unique to
    /// the node (0 for the one at MASTER_ADDR, which serves the
    /// launchers), its place in each attempt being the order it joined.
    #[arg(long, default_value_t = 0)]
    node_rank: usize,
    /// An elastic job's attempt starts once MAX nodes have joined, or
    /// this many seconds after MIN had (torchrun's `last_call_timeout`).
    #[arg(long, default_value_t = 30.0, value_name = "SECONDS")]
    last_call: f64,
    /// Address rank 0 serves the rendezvous store on (default 127.0.0.1;
    /// with --hostfile, its first host).
    #[arg(long)]
    master_addr: Option<String>,
    /// Its port (default: a free port below the ephemeral range for
    /// single-node jobs, 29500 otherwise). On several nodes node 0's
    /// launcher also serves the launchers on the port above it.
    #[arg(long)]
    master_port: Option<u16>,
    /// Seconds ranks get to exit after SIGTERM before SIGKILL.
    #[arg(long, default_value_t = 5.0)]
    grace: f64,
    /// Times every rank is started again after one fails (torchrun's
    /// `--max-restarts`; on several nodes every launcher restarts). Each
    /// attempt gets a fresh rendezvous, and the ranks see the restarts
    /// used in TORCHELASTIC_RESTART_COUNT (0 at first; an elastic job's
    /// node joining uses none).
    #[arg(long, default_value_t = 0)]
    max_restarts: u32,
    /// Also write each rank's output, unprefixed, to
    /// `DIR/attempt_N/rank_R/{stdout,stderr}.log` (torchrun's `--log-dir`),
    /// one folder per attempt so a restart keeps the failure's logs.
    #[arg(long, value_name = "DIR")]
    log_dir: Option<std::path::PathBuf>,
    /// The program and its arguments, after `--`.
    #[arg(trailing_var_arg = true, allow_hyphen_values = true, required = true, num_args = 1..)]
    program: Vec<String>,
    /// The job's token when this launcher made it for other nodes'
    /// (--hostfile); else ZRT_TOKEN's.
    #[arg(skip)]
    token: Option<String>,
}

/// `--nnodes`: N (`min == max`), or an elastic job's `MIN:MAX`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Nodes {
    min: usize,
    max: usize,
}

impl Nodes {
    /// A fixed count.
    fn fixed(n: usize) -> Self {
        Self { min: n, max: n }
    }
}

impl std::fmt::Display for Nodes {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.min == self.max {
            true => write!(f, "{}", self.max),
            false => write!(f, "{}:{}", self.min, self.max),
        }
    }
}

/// Parses `--nnodes N` or `--nnodes MIN:MAX`.
fn parse_nodes(s: &str) -> std::result::Result<Nodes, String> {
    let n = |t: &str| {
        t.trim()
            .parse::<usize>()
            .map_err(|_| format!("`{s}` is not N or MIN:MAX (whole numbers of nodes)"))
    };
    let nodes = match s.split_once(':') {
        None => Nodes::fixed(n(s)?),
        Some((lo, hi)) => Nodes {
            min: n(lo)?,
            max: n(hi)?,
        },
    };
    if nodes.min > nodes.max {
        return Err(format!("`{s}`: MIN is above MAX"));
    }
    Ok(nodes)
}

impl LaunchArgs {
    /// Ranks per node (0 when not given: refused by `Job::checked`).
    fn nproc(&self) -> usize {
        self.nproc_per_node.unwrap_or(0)
    }

    /// The address rank 0 (and node 0's launcher) serves its store on.
    fn master_addr(&self) -> &str {
        self.master_addr.as_deref().unwrap_or("127.0.0.1")
    }
}

/// The signal the launcher received (0: none), set by the handler.
static SIGNAL: AtomicI32 = AtomicI32::new(0);

extern "C" fn on_signal(sig: libc::c_int) {
    SIGNAL.store(sig, Ordering::SeqCst);
}

/// Whether the launcher got a signal (Ctrl-C, a scheduler's SIGTERM).
fn signalled() -> bool {
    SIGNAL.load(Ordering::SeqCst) != 0
}

fn random_token() -> Result<String> {
    let mut b = [0u8; 16];
    std::fs::File::open("/dev/urandom")
        .and_then(|mut f| std::io::Read::read_exact(&mut f, &mut b))
        .context("reading /dev/urandom for the job token")?;
    Ok(b.iter().map(|x| format!("{x:02x}")).collect())
}

/// The folder to prepend to the ranks' LD_LIBRARY_PATH so cudarc finds
/// NCCL: it looks for `libnccl.so` (and `.so.13` and older majors), but the
/// PyTorch wheel ships `nvidia/nccl/lib/libnccl.so.2`. We link it as
/// `~/.cache/zrt/nccl/libnccl.so`. `None` when the wheel has no NCCL.
fn nccl_dir() -> Option<std::path::PathBuf> {
    let lib = std::path::Path::new(option_env!("ZRT_LIBTORCH_LIB")?);
    let so2 = lib
        .join("../../nvidia/nccl/lib/libnccl.so.2")
        .canonicalize()
        .ok()?;
    let cache = std::env::var_os("ZRT_CACHE")
        .map(std::path::PathBuf::from)
        .or_else(|| {
            std::env::var_os("HOME").map(|h| std::path::Path::new(&h).join(".cache").join("zrt"))
        })?;
    let dir = cache.join("nccl");
    let link = dir.join("libnccl.so");
    if std::fs::read_link(&link).ok().as_deref() != Some(so2.as_path()) {
        std::fs::create_dir_all(&dir).ok()?;
        let _ = std::fs::remove_file(&link);
        std::os::unix::fs::symlink(&so2, &link).ok()?;
    }
    Some(dir)
}

/// Copies `from` to our stdout/stderr line by line, each after `prefix`
/// (`[rank R] `; nothing for a remote launcher's, whose ranks' lines have
/// theirs), and to `log` (`--log-dir`) as the rank wrote it.
///
/// Each prefixed line goes out in one `write`: `writeln!` on (unbuffered)
/// stderr writes the prefix, the rank and the text separately, and when
/// both streams are one file (`2>&1`) another rank's line landed between
/// the pieces.
fn pump(
    prefix: String,
    from: impl std::io::Read + Send + 'static,
    to_stderr: bool,
    mut log: Option<std::fs::File>,
) -> std::thread::JoinHandle<()> {
    std::thread::spawn(move || {
        let mut out = Vec::new();
        for line in BufReader::new(from).split(b'\n') {
            let Ok(line) = line else { break };
            out.clear();
            out.extend_from_slice(prefix.as_bytes());
            out.extend_from_slice(&line);
            out.push(b'\n');
            let _ = if to_stderr {
                write_line(&mut std::io::stderr().lock(), &out)
            } else {
                write_line(&mut std::io::stdout().lock(), &out)
            };
            // Written line by line, unbuffered: what a rank said before the
            // launcher itself was killed is in the file.
            if let Some(f) = &mut log {
                if f.write_all(&out[prefix.len()..]).is_err() {
                    // A full disk ends the copy to the file, not the job.
                    log = None;
                }
            }
        }
    })
}

/// The files `--log-dir` has rank `rank`'s stdout and stderr written to on
/// attempt `restart`: `DIR/attempt_N/rank_R/{stdout,stderr}.log`, replacing
/// what an earlier job left there.
fn log_files(dir: &std::path::Path, restart: u32, rank: usize) -> Result<[std::fs::File; 2]> {
    let d = dir
        .join(format!("attempt_{restart}"))
        .join(format!("rank_{rank}"));
    std::fs::create_dir_all(&d).with_context(|| {
        format!(
            "--log-dir: cannot make {} for rank {rank}'s output; give a folder this user can write to",
            d.display()
        )
    })?;
    let open = |name: &str| {
        let p = d.join(name);
        std::fs::File::create(&p).with_context(|| {
            format!(
                "--log-dir: cannot write {}; give a folder this user can write to",
                p.display()
            )
        })
    };
    Ok([open("stdout.log")?, open("stderr.log")?])
}

/// Writes one whole line and flushes it, so it is not split across writes.
fn write_line(to: &mut impl Write, line: &[u8]) -> std::io::Result<()> {
    to.write_all(line)?;
    to.flush()
}

/// Signals each rank's whole process group (each rank leads its own), so
/// whatever a rank started goes too and no stray process keeps its output
/// open.
fn signal_all(children: &mut [(usize, Child)], sig: libc::c_int) {
    for (_, c) in children.iter() {
        // SAFETY: kill(2) on the process groups our own children lead.
        unsafe { libc::kill(-(c.id() as libc::pid_t), sig) };
    }
}

/// Stops every child still running: `sig`, then SIGKILL after `grace`.
fn stop_all(children: &mut Vec<(usize, Child)>, sig: libc::c_int, grace: Duration) {
    signal_all(children, sig);
    // A grace too long for the clock (`--grace 1e19`) waits a century: in
    // effect, for the ranks to exit.
    let deadline = zrt::collectives::deadline_in(grace);
    while !children.is_empty() && Instant::now() < deadline {
        children.retain_mut(|(_, c)| !matches!(c.try_wait(), Ok(Some(_))));
        std::thread::sleep(Duration::from_millis(20));
    }
    signal_all(children, libc::SIGKILL);
    for (_, c) in children.iter_mut() {
        let _ = c.wait();
    }
    children.clear();
}

/// Has the rank killed when the launcher dies, however it dies.
///
/// The ranks lead their own process groups, so a launcher killed by
/// SIGKILL (a scheduler's, the OOM killer's) took nobody with it: its ranks
/// went on training, or waiting for peers, with nobody to read their output.
/// On Linux the kernel sends the rank SIGKILL when the launcher's thread
/// that started it ends (the main thread, which outlives the job); its
/// peers then see a dead rank and fail, as they would for any other.
#[cfg(target_os = "linux")]
pub(crate) fn die_with_launcher(cmd: &mut Command) {
    let launcher = std::process::id() as libc::pid_t;
    // SAFETY: prctl, getppid and raise are async-signal-safe, which is all
    // a pre_exec closure may call.
    unsafe {
        cmd.pre_exec(move || {
            if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            // The launcher died between the fork and the prctl: nobody
            // would send the signal now.
            if libc::getppid() != launcher {
                libc::raise(libc::SIGKILL);
            }
            Ok(())
        })
    };
}

/// Elsewhere there is no parent-death signal: a killed launcher leaves its
/// ranks running until they next write to their closed output pipe.
#[cfg(not(target_os = "linux"))]
pub(crate) fn die_with_launcher(_: &mut Command) {}

/// How many processes the kernel's out-of-memory killer has killed since
/// boot (`oom_kill` in `/proc/vmstat`, Linux 4.13 and later; it counts
/// kills for a memory cgroup's limit too). `None` where it is not kept.
fn oom_kills() -> Option<u64> {
    let vmstat = std::fs::read_to_string("/proc/vmstat").ok()?;
    let line = vmstat.lines().find(|l| l.starts_with("oom_kill "))?;
    line["oom_kill ".len()..].trim().parse().ok()
}

/// The OOM killer's kills between two readings of [`oom_kills`] (0 where
/// the counter is not kept).
fn oom_kills_since(before: Option<u64>, now: Option<u64>) -> u64 {
    match (before, now) {
        (Some(b), Some(n)) => n.saturating_sub(b),
        _ => 0,
    }
}

/// The advice that follows an out-of-memory kill.
const OOM_FIX: &str = "give each rank less to hold: fewer ranks per node (--nproc-per-node), \
a higher ZeRO stage, `offload_optimizer`, or a smaller micro-batch \
(`zrt estimate` gives the model state per rank)";

/// Whether a rank that died of signal `sig` is put down to the OOM killer:
/// a SIGKILL while the killer was at work (`oom_kills` since the job
/// started).
fn oom_took(sig: i32, oom_kills: u64) -> bool {
    sig == libc::SIGKILL && oom_kills > 0
}

/// How a rank that died of signal `sig` is described, given the OOM
/// killer's kills on this node since the job started: a SIGKILL the
/// launcher did not send, with the OOM killer at work meanwhile, was most
/// likely it (torchrun reports the same death as "exitcode -9" and nothing
/// more). The counter is the node's, so an unrelated process's OOM kill at
/// the same moment would be misread; hence "most likely".
fn killed_by(sig: i32, oom_kills: u64) -> String {
    let name = match sig {
        libc::SIGABRT => " (SIGABRT: the rank aborted; its last lines above say why)",
        libc::SIGKILL => " (SIGKILL)",
        libc::SIGSEGV => " (SIGSEGV)",
        libc::SIGBUS => " (SIGBUS: memory the rank mapped could not be backed, as when a file in a full /dev/shm is touched)",
        libc::SIGTERM => " (SIGTERM)",
        libc::SIGINT => " (SIGINT)",
        _ => "",
    };
    if oom_took(sig, oom_kills) {
        return format!(
            "was killed by signal 9 (SIGKILL) while the kernel's out-of-memory killer \
             was at work on this node (it killed {oom_kills} process(es) since the job \
             started): most likely the rank ran out of memory (the node's, or its memory \
             cgroup's limit); {OOM_FIX}"
        );
    }
    format!("was killed by signal {sig}{name}")
}

/// How a rank that exited with `code` is described. 127 is the code the
/// dynamic loader exits with when a shared library the program needs is
/// not found (and a shell's for a command it cannot find): for a program
/// of the user's own that links libtorch, the folder of libtorch is on
/// neither its rpath nor LD_LIBRARY_PATH. `libtorch` is the folder this
/// zrt was built with, the likely answer.
fn exited_with(code: i32, libtorch: Option<&str>) -> String {
    if code != 127 {
        return format!("exited with code {code}");
    }
    let ours = libtorch.map_or(String::new(), |d| format!("; this zrt was built with {d}"));
    format!(
        "exited with code 127, the dynamic loader's code for a shared library it could not \
         find (and a shell's for a command), named in the rank's line above: a program that \
         links libtorch needs libtorch's lib folder on its rpath (examples/own-project/build.rs \
         puts it there) or on LD_LIBRARY_PATH{ours}"
    )
}

/// The OMP_NUM_THREADS each rank gets, and the cores it came from, when
/// the user set none (`set`): the node's cores shared among its ranks, at
/// least one each. libtorch's intra-op pool (and so the engine's kernels,
/// which use as many threads) would otherwise take every core in every
/// rank, oversubscribing the node `nproc` times over; torchrun sets 1 for
/// the same reason.
fn omp_threads(set: bool, cores: usize, nproc: usize) -> Option<(usize, usize)> {
    (!set).then(|| ((cores / nproc.max(1)).max(1), cores))
}

fn code_of(st: std::process::ExitStatus) -> i32 {
    st.code().unwrap_or_else(|| 128 + st.signal().unwrap_or(0))
}

/// What every attempt of a job shares, worked out from the arguments once.
struct Job<'a> {
    a: &'a LaunchArgs,
    grace: Duration,
    /// `--last-call`.
    last_call: Duration,
    /// The user's ZRT_TOKEN; `None`: a fresh one for each attempt.
    token: Option<String>,
    /// The port asked for, or a multi-node job's default; `None`: a free
    /// one for each attempt.
    port: Option<u16>,
    /// The ranks' LD_LIBRARY_PATH, when the wheel's NCCL goes on it.
    ld_path: Option<std::ffi::OsString>,
    /// OMP_NUM_THREADS for each rank, when the user set none.
    omp_threads: Option<(usize, usize)>,
}

impl<'a> Job<'a> {
    /// Checks the arguments and the environment: every mistake is refused
    /// here, before a rank starts.
    fn checked(a: &'a LaunchArgs) -> Result<Self> {
        if a.nproc_per_node.is_none() {
            bail!("--nproc-per-node N is needed: the ranks to start on each node (or --hostfile FILE, whose slots give it)");
        }
        if a.nproc() == 0 || a.nnodes.min == 0 {
            bail!("--nproc-per-node and --nnodes must be at least 1");
        }
        // An elastic job's node ranks are names, not places.
        if a.node_rank >= a.nnodes.max && a.nnodes.min == a.nnodes.max {
            bail!(
                "--node-rank {} must be below --nnodes {}",
                a.node_rank,
                a.nnodes.max
            );
        }
        let Ok(last_call) = Duration::try_from_secs_f64(a.last_call) else {
            bail!(
                "--last-call {} must be a number of seconds, 0 or more",
                a.last_call
            );
        };
        if a.nnodes.max.checked_mul(a.nproc()).is_none() {
            bail!(
                "--nnodes {} x --nproc-per-node {} ranks is more than this machine can count",
                a.nnodes.max,
                a.nproc()
            );
        }
        // Port 0 would have rank 0's store listen on a port the kernel picks,
        // which no other rank could know: they would wait out the timeout.
        if a.master_port == Some(0) {
            bail!("--master-port 0 names no port the ranks could meet on: give a port from 1 to 65535, or leave it out on one node for a free one");
        }
        // Launchers on several nodes meet at a store of their own, on the
        // port above the ranks' (see `agents`).
        if a.master_port == Some(u16::MAX) && a.nnodes.max > 1 {
            bail!("--master-port 65535 leaves no port above it for the launchers' own store, which a job on several nodes needs (MASTER_PORT + 1): give a lower port");
        }
        let grace = match Duration::try_from_secs_f64(a.grace) {
            Ok(g) => g,
            Err(_) => bail!(
                "--grace {} must be a number of seconds, 0 or more (how long ranks get between SIGTERM and SIGKILL)",
                a.grace
            ),
        };
        let token = a.token.clone().or_else(|| std::env::var("ZRT_TOKEN").ok());
        let token = match token {
            Some(t) if !t.is_empty() => Some(t),
            _ if a.nnodes.max > 1 => bail!(
                "a job on several nodes needs the same ZRT_TOKEN on every node: export ZRT_TOKEN=<random hex> on each before `zrt launch`"
            ),
            _ => None,
        };
        let port = match a.master_port {
            Some(p) => Some(p),
            None if a.nnodes.max == 1 => None,
            None => Some(29500),
        };

        let ld_path = nccl_dir().map(|d| {
            let mut p = d.into_os_string();
            if let Some(old) = std::env::var_os("LD_LIBRARY_PATH") {
                p.push(":");
                p.push(old);
            }
            p
        });
        let omp_threads = omp_threads(
            // Empty is unset to OpenMP too.
            std::env::var_os("OMP_NUM_THREADS").is_some_and(|v| !v.is_empty()),
            std::thread::available_parallelism().map_or(1, |n| n.get()),
            a.nproc(),
        );
        Ok(Self {
            a,
            grace,
            last_call,
            token,
            port,
            ld_path,
            omp_threads,
        })
    }
}

/// One attempt's ranks: the processes, the process groups they lead, and
/// the threads copying their output.
struct Ranks {
    children: Vec<(usize, Child)>,
    groups: Vec<libc::pid_t>,
    pumps: Vec<std::thread::JoinHandle<()>>,
}

/// Starts this node's ranks for its place `at` in an attempt of the job;
/// a rank that cannot start stops those already started.
fn start(job: &Job, at: Place) -> Result<Ranks> {
    let a = job.a;
    // A fresh rendezvous for each attempt: nothing of an earlier one's
    // store (its port, its token) is met again.
    let token = match &job.token {
        Some(t) => t.clone(),
        None => random_token()?,
    };
    let port = match job.port {
        Some(p) => p,
        None => zrt::collectives::store::free_store_port(a.master_addr())?,
    };
    let ranks = || (0..a.nproc()).map(|local| (local, at.node * a.nproc() + local));
    // Every log file made before any rank starts: a folder that cannot be
    // written stops the job with no rank to stop.
    let mut logs = Vec::new();
    for (_, rank) in ranks() {
        logs.push(match &a.log_dir {
            Some(d) => log_files(d, at.round, rank)?.map(Some),
            None => [None, None],
        });
    }
    let mut r = Ranks {
        children: Vec::new(),
        groups: Vec::new(),
        pumps: Vec::new(),
    };
    for ((local, rank), [out_log, err_log]) in ranks().zip(logs) {
        let mut cmd = Command::new(&a.program[0]);
        cmd.args(&a.program[1..])
            .env("RANK", rank.to_string())
            .env("WORLD_SIZE", (at.nnodes * a.nproc()).to_string())
            .env("LOCAL_RANK", local.to_string())
            .env("LOCAL_WORLD_SIZE", a.nproc().to_string())
            .env("MASTER_ADDR", a.master_addr())
            .env("MASTER_PORT", port.to_string())
            .env("ZRT_TOKEN", &token)
            // torchrun's names, which programs read to tell a restart and
            // which node they are on.
            .env("TORCHELASTIC_RESTART_COUNT", at.restarts.to_string())
            .env("TORCHELASTIC_MAX_RESTARTS", a.max_restarts.to_string())
            .env("GROUP_RANK", at.node.to_string())
            .env("GROUP_WORLD_SIZE", at.nnodes.to_string())
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            // Own process group: a terminal's Ctrl-C reaches only the launcher,
            // which forwards it exactly once.
            .process_group(0);
        if let Some(p) = &job.ld_path {
            cmd.env("LD_LIBRARY_PATH", p);
        }
        if let Some((threads, _)) = job.omp_threads {
            cmd.env("OMP_NUM_THREADS", threads.to_string());
        }
        die_with_launcher(&mut cmd);
        let mut child = match cmd.spawn() {
            Ok(c) => c,
            Err(e) => {
                stop_all(&mut r.children, libc::SIGTERM, job.grace);
                bail!("cannot start `{}` for rank {rank}: {e}", a.program[0]);
            }
        };
        r.groups.push(child.id() as libc::pid_t);
        if let Some(o) = child.stdout.take() {
            r.pumps
                .push(pump(format!("[rank {rank}] "), o, false, out_log));
        }
        if let Some(e) = child.stderr.take() {
            r.pumps
                .push(pump(format!("[rank {rank}] "), e, true, err_log));
        }
        r.children.push((rank, child));
    }
    Ok(r)
}

/// How an attempt ended.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Ended {
    /// Another node's launcher reported this failure; this node's ranks
    /// were stopped for it.
    PeerFailed(Failure),
    /// Every rank exited with code 0.
    Done,
    /// The launcher got `signal` and passed it on.
    Signalled(i32),
    /// `rank` was the first to fail, with `code` (128 + the signal that
    /// killed it).
    Failed { rank: usize, code: i32 },
}

/// Waits for an attempt's ranks: when one fails (or the launcher gets a
/// signal, or `peer` reports another node's failure) the others are
/// stopped. Returns once every rank and everything they started is gone
/// and their output is copied out.
fn supervise(
    mut r: Ranks,
    grace: Duration,
    peer: &mut dyn FnMut() -> Result<Option<Failure>>,
) -> Result<Ended> {
    // Read before waiting, so a rank the OOM killer takes can be told from
    // one killed by hand (the ranks are only just started).
    let oom_before = oom_kills();
    let mut ended = Ended::Done;
    // Whether the failure named is the OOM killer's.
    let mut named_oom = false;
    while !r.children.is_empty() {
        let sig = SIGNAL.load(Ordering::SeqCst);
        if sig != 0 {
            eprintln!("zrt launch: got signal {sig}, forwarding it to every rank");
            stop_all(&mut r.children, sig, grace);
            if ended == Ended::Done {
                ended = Ended::Signalled(sig);
            }
            break;
        }
        let theirs = match peer() {
            Ok(f) => f,
            Err(e) => {
                // The launchers' store is gone with node 0's launcher: the
                // job cannot go on as one.
                stop_all(&mut r.children, libc::SIGTERM, grace);
                return Err(
                    e.context("watching the other nodes' launchers; stopped this node's ranks")
                );
            }
        };
        if let (Some(f), Ended::Done) = (theirs, &ended) {
            eprintln!(
                "zrt launch: {}; stopping this node's {} rank(s)",
                f.what,
                r.children.len()
            );
            stop_all(&mut r.children, libc::SIGTERM, grace);
            ended = Ended::PeerFailed(f);
            break;
        }
        let mut i = 0;
        while i < r.children.len() {
            match r.children[i].1.try_wait() {
                Ok(Some(st)) => {
                    let (rank, _) = r.children.remove(i);
                    let code = code_of(st);
                    if code != 0 && ended == Ended::Done {
                        ended = Ended::Failed { rank, code };
                        let oom = oom_kills_since(oom_before, oom_kills());
                        named_oom = st.signal().is_some_and(|s| oom_took(s, oom));
                        let how = match st.signal() {
                            Some(s) => killed_by(s, oom),
                            None => exited_with(code, option_env!("ZRT_LIBTORCH_LIB")),
                        };
                        eprintln!(
                            "zrt launch: rank {rank} {how}; stopping the other {} rank(s)",
                            r.children.len()
                        );
                        stop_all(&mut r.children, libc::SIGTERM, grace);
                    }
                }
                Ok(None) => i += 1,
                Err(e) => {
                    // The ranks lead their own process groups: a launcher that
                    // returned here without stopping them would orphan them.
                    let rank = r.children[i].0;
                    stop_all(&mut r.children, libc::SIGTERM, grace);
                    bail!("waiting for rank {rank}: {e}; stopped every rank");
                }
            }
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    // The job's processes end with the job: anything a rank left running in
    // its process group would otherwise keep its output pipe (and us) open.
    for pg in r.groups {
        // SAFETY: kill(2) on process groups our children led; an empty group is ESRCH.
        unsafe { libc::kill(-pg, libc::SIGKILL) };
    }
    for p in r.pumps {
        let _ = p.join();
    }
    // A rank the OOM killer took may not be the one named above: its peers
    // can fail first (a collective naming the dead rank), or it may have
    // been a child process of a rank.
    let oom = oom_kills_since(oom_before, oom_kills());
    if oom > 0 && ended != Ended::Done && !named_oom {
        eprintln!(
            "zrt launch: the kernel's out-of-memory killer killed {oom} process(es) on this \
             node while the job ran; if they were the job's, {OOM_FIX}"
        );
    }
    Ok(ended)
}

/// Runs the job, restarting every rank after a failure while
/// `--max-restarts` allows; returns the launcher's exit code.
pub fn run(a: &LaunchArgs) -> Result<ExitCode> {
    let from_hostfile;
    let (a, hosts) = match &a.hostfile {
        Some(f) => {
            let (args, hosts) = hosts::resolve(a, f)?;
            from_hostfile = args;
            (&from_hostfile, hosts)
        }
        None => (a, Vec::new()),
    };
    let job = Job::checked(a)?;
    // SAFETY: installing a handler that only stores to an atomic.
    unsafe {
        libc::signal(libc::SIGINT, on_signal as *const () as libc::sighandler_t);
        libc::signal(libc::SIGTERM, on_signal as *const () as libc::sighandler_t);
    }
    if let Some((threads, cores)) = job.omp_threads {
        eprintln!(
            "zrt launch: OMP_NUM_THREADS is not set: each rank gets {threads} thread(s), \
             this node's {cores} core(s) shared by {} ranks; set OMP_NUM_THREADS to choose",
            a.nproc()
        );
    }
    // Launchers on several nodes stop, restart and end their ranks
    // together: a failure on one node ends every node's attempt at once
    // (not when the others' collectives notice), and every launcher exits
    // with the failed rank's code.
    let elastic = (a.nnodes.min < a.nnodes.max).then_some(Elastic {
        min: a.nnodes.min,
        max: a.nnodes.max,
        last_call: job.last_call,
    });
    let mut agents = match (a.nnodes.max > 1, job.port, &job.token) {
        (true, Some(port), Some(token)) => Some(Agents::join(
            a.master_addr(),
            port + 1,
            token,
            a.node_rank,
            a.nnodes.max,
            elastic,
            &format!(
                "--nnodes {} --nproc-per-node {} --max-restarts {}",
                a.nnodes,
                a.nproc(),
                a.max_restarts
            ),
        )?),
        _ => None,
    };
    // The other nodes of a hostfile, started once this launcher serves
    // the store they meet at.
    if let (Some(ag), Some(port), Some(token)) = (agents.as_mut(), job.port, &job.token) {
        if hosts.len() > 1 {
            ag.watch_remotes(hosts::Remotes::start(a, &hosts, port, token)?);
        }
    }
    // Restarts used, for a job on one node (several nodes' launchers
    // keep the count in their store).
    let mut used = 0;
    let mut round = 0;
    loop {
        let at = match agents.as_mut() {
            None => Place {
                round,
                node: 0,
                nnodes: 1,
                restarts: used,
            },
            Some(ag) => match ag.ready(round)? {
                Some(at) => at,
                None => {
                    eprintln!("zrt launch: the job ended before this node could join it");
                    return Ok(ExitCode::SUCCESS);
                }
            },
        };
        round = at.round;
        let ranks = match start(&job, at) {
            Ok(r) => r,
            Err(e) => {
                let Some(ag) = agents.take() else {
                    return Err(e);
                };
                // Said to the other nodes, whose ranks would otherwise wait
                // for this node's until their timeout. A program that does
                // not start will not on a restart either: the job ends.
                let f = Failure::new(
                    1,
                    true,
                    format!(
                        "node {}'s launcher could not start its ranks ({e:#})",
                        a.node_rank
                    ),
                );
                if let Err(e2) = ag.report(round, f) {
                    tracing::debug!("telling the other launchers: {e2:#}");
                }
                // Node 0's store stays up until the others have read it.
                ag.leave();
                return Err(e);
            }
        };
        let mut peer = || match &agents {
            Some(ag) => ag.watch(round),
            None => Ok(None),
        };
        let ended = supervise(ranks, job.grace, &mut peer)?;
        let Some(failure) = outcome(a, agents.as_ref(), round, ended)? else {
            if at.restarts > 0 {
                // The failures above did not end the job: say so last.
                eprintln!(
                    "zrt launch: every rank ended well after {} restart(s)",
                    at.restarts
                );
            }
            if let Some(ag) = agents {
                ag.leave();
            }
            return Ok(ExitCode::SUCCESS);
        };
        // A signal to a launcher (Ctrl-C, a scheduler's SIGTERM) ends the
        // job, even one that arrived while the ranks were being stopped.
        if !failure.stop && !signalled() {
            if failure.rejoin {
                round += 1;
                eprintln!(
                    "zrt launch: {}; every node starts attempt {round} with it",
                    failure.what
                );
                continue;
            }
            used = match &agents {
                Some(ag) => ag.restarts_used()?,
                None => used + 1,
            };
            if used <= a.max_restarts {
                round += 1;
                eprintln!(
                    "zrt launch: restarting every rank (restart {used} of {}; the ranks see TORCHELASTIC_RESTART_COUNT={used}: a program that loads its latest checkpoint goes on from there)",
                    a.max_restarts
                );
                continue;
            }
            if a.max_restarts > 0 {
                eprintln!(
                    "zrt launch: no restarts left (--max-restarts {} used); exiting with code {}",
                    a.max_restarts, failure.code
                );
            }
        }
        if let Some(ag) = agents {
            ag.leave();
        }
        // A signal that came as every node restarted for a node joining
        // (a record with no failed rank's code) is the launcher's code.
        let code = match (failure.code, SIGNAL.load(Ordering::SeqCst)) {
            (0, sig) if sig != 0 => 128 + sig,
            (code, _) => code,
        };
        return Ok(ExitCode::from(u8::try_from(code).unwrap_or(1)));
    }
}

/// How attempt `restart` of the job ended for every node, from how it
/// ended here (`None`: well). With several nodes' launchers, the first
/// failure any of them reported, so that all restart, or end, alike.
fn outcome(
    a: &LaunchArgs,
    agents: Option<&Agents>,
    restart: u32,
    ended: Ended,
) -> Result<Option<Failure>> {
    let node = a.node_rank;
    let mine = match ended {
        Ended::Done => None,
        Ended::PeerFailed(f) => return Ok(Some(f)),
        Ended::Signalled(sig) => Some(Failure::new(
            128 + sig,
            true,
            format!("node {node}'s launcher got signal {sig}"),
        )),
        // A signal that came while its peers were being stopped ends
        // every node's job too.
        Ended::Failed { rank, code } => Some(Failure::new(
            code,
            signalled(),
            format!("node {node}'s rank {rank} failed (code {code})"),
        )),
    };
    match (agents, mine) {
        (None, mine) => Ok(mine),
        (Some(ag), None) => ag.finish(restart),
        (Some(ag), Some(f)) => ag.report(restart, f).map(Some),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nnodes_reads_n_or_min_max_and_refuses_the_rest() {
        assert_eq!(parse_nodes("3"), Ok(Nodes::fixed(3)));
        assert_eq!(parse_nodes("1:4"), Ok(Nodes { min: 1, max: 4 }));
        assert_eq!(parse_nodes("2:2"), Ok(Nodes::fixed(2)));
        assert_eq!(Nodes::fixed(3).to_string(), "3");
        assert_eq!(Nodes { min: 1, max: 4 }.to_string(), "1:4");
        for (bad, want) in [
            ("3:2", "`3:2`: MIN is above MAX"),
            ("a", "`a` is not N or MIN:MAX (whole numbers of nodes)"),
            ("1:", "`1:` is not N or MIN:MAX (whole numbers of nodes)"),
            ("-1", "`-1` is not N or MIN:MAX (whole numbers of nodes)"),
        ] {
            assert_eq!(parse_nodes(bad).unwrap_err(), want, "{bad}");
        }
    }

    #[test]
    fn a_rank_killed_by_a_signal_is_described_by_its_name_and_the_oom_killer() {
        assert_eq!(
            killed_by(libc::SIGABRT, 0),
            "was killed by signal 6 (SIGABRT: the rank aborted; its last lines above say why)"
        );
        for (sig, name) in [
            (libc::SIGKILL, "SIGKILL"),
            (libc::SIGSEGV, "SIGSEGV"),
            (libc::SIGTERM, "SIGTERM"),
            (libc::SIGINT, "SIGINT"),
        ] {
            assert_eq!(
                killed_by(sig, 0),
                format!("was killed by signal {sig} ({name})")
            );
        }
        assert!(killed_by(libc::SIGBUS, 0).starts_with("was killed by signal 7 (SIGBUS: memory"));
        assert_eq!(killed_by(libc::SIGUSR1, 0), "was killed by signal 10");
        // Only a SIGKILL is put down to the OOM killer, and only when it ran.
        let oom = killed_by(libc::SIGKILL, 2);
        assert!(
            oom.starts_with(
                "was killed by signal 9 (SIGKILL) while the kernel's out-of-memory killer"
            ) && oom.contains("it killed 2 process(es) since the job started")
                && oom.ends_with(OOM_FIX),
            "{oom}"
        );
        assert!(!killed_by(libc::SIGABRT, 2).contains("out-of-memory"));
    }

    #[test]
    fn an_exit_code_of_127_is_put_down_to_a_library_not_found() {
        assert_eq!(exited_with(1, Some("/t/lib")), "exited with code 1");
        assert_eq!(exited_with(126, None), "exited with code 126");
        let missing = exited_with(127, Some("/t/lib"));
        assert!(
            missing.starts_with(
                "exited with code 127, the dynamic loader's code for a shared library"
            ) && missing.contains("examples/own-project/build.rs")
                && missing.ends_with("or on LD_LIBRARY_PATH; this zrt was built with /t/lib"),
            "{missing}"
        );
        assert!(exited_with(127, None).ends_with("or on LD_LIBRARY_PATH"));
    }

    #[test]
    fn ranks_share_the_nodes_cores_unless_omp_num_threads_is_set() {
        assert_eq!(omp_threads(false, 2, 2), Some((1, 2)));
        assert_eq!(omp_threads(false, 16, 4), Some((4, 16)));
        assert_eq!(omp_threads(false, 16, 3), Some((5, 16)));
        assert_eq!(omp_threads(false, 2, 8), Some((1, 2)), "at least one");
        assert_eq!(omp_threads(true, 16, 4), None, "the user's choice stands");
    }

    #[test]
    fn oom_kills_are_counted_between_two_readings() {
        assert_eq!(oom_kills_since(Some(3), Some(5)), 2);
        assert_eq!(oom_kills_since(Some(5), Some(5)), 0);
        // A counter that went back (it cannot) or is not kept counts none.
        assert_eq!(oom_kills_since(Some(5), Some(3)), 0);
        assert_eq!(oom_kills_since(None, Some(5)), 0);
        assert_eq!(oom_kills_since(Some(5), None), 0);
        // The kernels this project runs on keep it.
        assert!(oom_kills().is_some());
    }
}

//! Python scripts for the tests, run in the libtorch venv's Python by a
//! fork server.
//!
//! Importing `torch` and `transformers` (with `modeling_utils`, which every
//! model class pulls in) takes 4 to 9 seconds of one core here, more than
//! most of the scripts themselves, and the tests run about seventy of them.
//! So each test binary starts a server (one per test thread that runs a
//! script at the same time) that imports them once and forks a child per
//! script: the child starts with the modules loaded, runs the script as
//! `python -c` would (as `__main__`, its stdout and stderr in files of its
//! own) and exits; the server replies with its exit code. The parent
//! never computes, so no thread pool of libtorch's exists yet when it
//! forks. The scripts compute on one thread (see [`start`]) so that a
//! reference is the same number in every run. Each child's RNGs start
//! where the server's were after its imports (a fresh process seeds them
//! anew each time): the scripts seed their own, as they did before.

use std::io::{BufRead, BufReader, Write};
use std::path::PathBuf;
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;

/// The server: reads one request per line (the script, and the files for
/// its stdout and stderr, as JSON), answers each with the child's exit
/// code. It ends when its stdin closes, that is when the test binary
/// exits.
const SERVER: &str = r#"
import json, os, sys, traceback
reply = os.fdopen(os.dup(1), "w")
# What the imports print goes to stderr: never into a reply, nor left in
# a buffer each child would inherit and print again.
os.dup2(2, 1)
import torch, transformers, transformers.modeling_utils, safetensors.torch
for line in sys.stdin:
    req = json.loads(line)
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            for fd, path in ((1, req["out"]), (2, req["err"])):
                f = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
                os.dup2(f, fd)
                os.close(f)
            sys.stdin = open(os.devnull)
            sys.argv = ["-c"]
            try:
                exec(compile(req["script"], "<string>", "exec"), {"__name__": "__main__"})
                code = 0
            except SystemExit as e:
                code = e.code if isinstance(e.code, int) else (e.code is not None)
                if isinstance(e.code, str):
                    print(e.code, file=sys.stderr)
            except BaseException:
                traceback.print_exc()
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    reply.write("%d\n" % os.waitstatus_to_exitcode(status))
    reply.flush()
"#;

/// A running server and its pipes.
struct Server {
    child: Child,
    requests: ChildStdin,
    replies: BufReader<ChildStdout>,
}

/// Servers not running a script now; a thread takes one, or starts one.
static IDLE: Mutex<Vec<Server>> = Mutex::new(Vec::new());
/// Numbers the output files of this binary's scripts.
static SCRIPTS: AtomicUsize = AtomicUsize::new(0);

/// The libtorch venv's Python (`.libtorch` links into its site-packages:
/// `<venv>/lib/pythonX.Y/site-packages/torch`).
fn venv_python() -> PathBuf {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
    let torch =
        std::fs::canonicalize(root.join(".libtorch")).expect(".libtorch: run `cargo xtask setup`");
    torch.ancestors().nth(4).unwrap().join("bin").join("python")
}

/// A new server (its imports done in the background while the first
/// request waits in its pipe).
fn start() -> Server {
    let mut child = Command::new(venv_python())
        .args(["-c", SERVER])
        // The references must not change from run to run. With two
        // threads, one process in about thirty computed GPT-2's logits
        // 1.5e-5 (relative) from the others' (MKL's matrix products, it
        // seems: pinning MKL's code path steadied them, at other
        // numbers); with one thread every process computed the common
        // numbers. zrt's side is left alone, so what is compared is what
        // users run.
        .env("OMP_NUM_THREADS", "1")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .expect("starting the venv's Python");
    let requests = child.stdin.take().unwrap();
    let replies = BufReader::new(child.stdout.take().unwrap());
    Server {
        child,
        requests,
        replies,
    }
}

/// Runs `script` in the libtorch venv's Python, as `python -c` would in a
/// process that had imported `torch`, `transformers` and
/// `safetensors.torch`, and returns what it printed; a script that fails
/// fails the test with its stderr.
pub fn python(script: &str) -> String {
    let mut server = IDLE
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .pop()
        .unwrap_or_else(start);
    let n = SCRIPTS.fetch_add(1, Ordering::Relaxed);
    let file =
        |what: &str| std::env::temp_dir().join(format!("zrt-py-{}-{n}.{what}", std::process::id()));
    let (out, err) = (file("out"), file("err"));
    let request = serde_json::json!({"script": script, "out": out, "err": err});
    let mut reply = String::new();
    let sent = writeln!(server.requests, "{request}").and_then(|()| server.requests.flush());
    let code = sent
        .and_then(|()| server.replies.read_line(&mut reply))
        .ok()
        .and_then(|_| reply.trim().parse::<i32>().ok());
    let read = |p: &PathBuf| {
        let text = std::fs::read(p).map(|b| String::from_utf8_lossy(&b).into_owned());
        let _ = std::fs::remove_file(p);
        text.unwrap_or_default()
    };
    let (stdout, stderr) = (read(&out), read(&err));
    let Some(code) = code else {
        let status = server.child.try_wait();
        panic!("the Python server stopped ({status:?}) running a script; the script's stderr:\n{stderr}");
    };
    IDLE.lock().unwrap_or_else(|e| e.into_inner()).push(server);
    assert!(code == 0, "exit code {code}\n{stderr}");
    stdout
}

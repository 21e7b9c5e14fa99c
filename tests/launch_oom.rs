//! `zrt launch` naming a rank the kernel's out-of-memory killer took. In a
//! binary of its own: the launcher reads the node's count of OOM kills, so
//! no other test may run beside this one (cargo runs test binaries one at
//! a time).

use std::path::PathBuf;
use std::process::Command;
use std::time::{Duration, Instant};

/// A memory cgroup of 64 MiB under this process's own (cgroup v1, as this
/// project's machines and CI have, or v2), removed on drop.
struct SmallCgroup(PathBuf);

impl SmallCgroup {
    fn new(name: &str) -> Self {
        let own = std::fs::read_to_string("/proc/self/cgroup").unwrap();
        let limit = 64 << 20;
        // v1: "N:memory:/path"; v2: "0::/path".
        let (dir, file) = match own.lines().find_map(|l| l.split_once(":memory:")) {
            Some((_, path)) => (
                format!("/sys/fs/cgroup/memory{path}"),
                "memory.limit_in_bytes",
            ),
            None => {
                let path = own.lines().find_map(|l| l.strip_prefix("0::")).unwrap();
                (format!("/sys/fs/cgroup{path}"), "memory.max")
            }
        };
        let cg = PathBuf::from(dir.trim_end_matches('/')).join(name);
        let made = std::fs::create_dir_all(&cg)
            .and_then(|_| std::fs::write(cg.join(file), limit.to_string()));
        // No swap either, where the host has some: a cgroup that can swap
        // would page the `tail` out instead of running out.
        for (swap, value) in [
            ("memory.memsw.limit_in_bytes", limit),
            ("memory.swap.max", 0),
        ] {
            if cg.join(swap).exists() {
                let _ = std::fs::write(cg.join(swap), value.to_string());
            }
        }
        assert!(
            made.is_ok(),
            "cannot make a memory cgroup at {} (needs root): {made:?}",
            cg.display()
        );
        SmallCgroup(cg)
    }
}

impl Drop for SmallCgroup {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir(&self.0);
    }
}

/// Runs two ranks under `zrt launch`; rank 0 moves into `cg` (or gives
/// up: outside it, the `tail` would take the whole machine's memory) and
/// runs `tail` on a line of /dev/zero, which never ends, so the OOM killer
/// takes the `tail`: `exec`ed, as the rank itself, or as its child. The
/// other rank sleeps until stopped; 20 s of CPU time bound the `tail`
/// where the cgroup does not stop it (the test then fails, naming
/// SIGXCPU). Returns the exit code and the output.
fn rank_0_runs_out_of_memory(cg: &SmallCgroup, exec: bool) -> (Option<i32>, String) {
    let t0 = Instant::now();
    let tail = if exec { "exec tail" } else { "tail" };
    let o = Command::new(env!("CARGO_BIN_EXE_zrt"))
        .env_remove("ZRT_TOKEN")
        .args(["launch", "--nproc-per-node", "2", "--", "sh", "-c"])
        .arg(format!(
            "if [ $RANK = 0 ]; then echo $$ > \"$CG/cgroup.procs\" || exit 3; \
             ulimit -t 20; {tail} -n 1 /dev/zero; exit $?; fi; sleep 60"
        ))
        .env("CG", &cg.0)
        .output()
        .unwrap();
    assert!(
        t0.elapsed() < Duration::from_secs(30),
        "took {:?}",
        t0.elapsed()
    );
    let t = format!(
        "{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    );
    (o.status.code(), t)
}

#[test]
fn a_rank_the_oom_killer_took_is_named_with_the_fix() {
    let cg = SmallCgroup::new(&format!("zrt-oom-{}", std::process::id()));
    let (code, t) = rank_0_runs_out_of_memory(&cg, true);
    assert_eq!(code, Some(137), "{t}");
    assert!(
        t.contains(
            "zrt launch: rank 0 was killed by signal 9 (SIGKILL) while the kernel's \
             out-of-memory killer was at work on this node (it killed 1 process(es) since \
             the job started): most likely the rank ran out of memory"
        ) && t.contains("fewer ranks per node (--nproc-per-node), a higher ZeRO stage"),
        "{t}"
    );
    // Named once: the closing note is for OOM kills the first line did
    // not already name.
    assert_eq!(t.matches("out-of-memory killer").count(), 1, "{t}");
    // The OOM killer takes a rank's child: the rank exits with a code (the
    // shell's 137), and the closing note says the OOM killer was at work.
    let (code, t) = rank_0_runs_out_of_memory(&cg, false);
    assert_eq!(code, Some(137), "{t}");
    assert!(
        t.contains("zrt launch: rank 0 exited with code 137; stopping the other 1 rank(s)")
            && t.contains(
                "zrt launch: the kernel's out-of-memory killer killed 1 process(es) on this \
                 node while the job ran; if they were the job's, give each rank less to hold"
            ),
        "{t}"
    );
}

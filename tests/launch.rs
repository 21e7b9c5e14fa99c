//! `zrt launch` end to end, with `sh` as the ranks' program.

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// A fresh empty folder for one test (`zrt-NAME-PID` in the temp
/// directory); the test removes it.
fn scratch(name: &str) -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!("zrt-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

fn zrt() -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_zrt"));
    c.env_remove("ZRT_TOKEN");
    c
}

fn text(o: &std::process::Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

#[test]
fn every_rank_gets_the_contract_and_its_lines_are_prefixed() {
    let o = zrt()
        .args(["launch", "--nproc-per-node", "3", "--", "sh", "-c"])
        .arg("echo env $RANK $WORLD_SIZE $LOCAL_RANK $LOCAL_WORLD_SIZE $MASTER_ADDR ${#ZRT_TOKEN} $TORCHELASTIC_RESTART_COUNT $TORCHELASTIC_MAX_RESTARTS $GROUP_RANK $GROUP_WORLD_SIZE; echo err >&2")
        .output()
        .unwrap();
    let t = text(&o);
    assert!(o.status.success(), "{t}");
    for r in 0..3 {
        // A 32-hex-digit token was generated and passed.
        assert!(
            t.contains(&format!("[rank {r}] env {r} 3 {r} 3 127.0.0.1 32 0 0 0 1")),
            "{t}"
        );
        assert!(t.contains(&format!("[rank {r}] err")), "{t}");
    }
}

#[test]
fn ranks_get_their_share_of_the_cores_unless_omp_num_threads_is_set() {
    let cores = std::thread::available_parallelism().unwrap().get();
    let run = |omp: Option<&str>| {
        let mut c = zrt();
        c.args(["launch", "--nproc-per-node", "2", "--", "sh", "-c"])
            .arg("echo threads=$OMP_NUM_THREADS");
        match omp {
            Some(v) => c.env("OMP_NUM_THREADS", v),
            None => c.env_remove("OMP_NUM_THREADS"),
        };
        let o = c.output().unwrap();
        assert!(o.status.success(), "{}", text(&o));
        text(&o)
    };
    let share = (cores / 2).max(1);
    // An empty OMP_NUM_THREADS is unset to OpenMP, and to the launcher.
    for t in [run(None), run(Some(""))] {
        for r in 0..2 {
            assert!(t.contains(&format!("[rank {r}] threads={share}\n")), "{t}");
        }
    }
    let t = run(None);
    assert!(
        t.contains(&format!(
            "zrt launch: OMP_NUM_THREADS is not set: each rank gets {share} thread(s), this \
             node's {cores} core(s) shared by 2 ranks"
        )),
        "{t}"
    );
    let t = run(Some("3"));
    assert!(
        t.contains("[rank 0] threads=3\n") && t.contains("[rank 1] threads=3\n"),
        "{t}"
    );
    assert!(!t.contains("OMP_NUM_THREADS is not set"), "{t}");
}

#[test]
fn an_empty_zrt_token_is_replaced_on_one_node() {
    // An exported but empty ZRT_TOKEN is no secret: one node makes its own.
    let o = zrt()
        .args(["launch", "--nproc-per-node", "1", "--", "sh", "-c"])
        .arg("echo token ${#ZRT_TOKEN}")
        .env("ZRT_TOKEN", "")
        .output()
        .unwrap();
    let t = text(&o);
    assert!(o.status.success() && t.contains("[rank 0] token 32"), "{t}");
}

#[test]
fn a_second_nodes_ranks_come_after_the_first_nodes_on_port_29500() {
    // Launchers of a job on several nodes must agree on the port without
    // talking: the default is torchrun's, not a free port each picks (the
    // launchers meet on the port above it).
    let [a, b] =
        [0, 1].map(|node| {
            zrt()
            .args(["launch", "--nproc-per-node", "2", "--nnodes", "2"])
            .args(["--node-rank", &node.to_string(), "--master-addr", "127.0.0.1"])
            .args([
                "--",
                "sh",
                "-c",
                "echo env $RANK $WORLD_SIZE $LOCAL_RANK $MASTER_PORT $GROUP_RANK $GROUP_WORLD_SIZE",
            ])
            .env("ZRT_TOKEN", "shared-secret")
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap()
        });
    let (a, b) = (a.wait_with_output().unwrap(), b.wait_with_output().unwrap());
    let (ta, tb) = (text(&a), text(&b));
    assert!(a.status.success() && b.status.success(), "{ta}\n{tb}");
    assert!(
        ta.contains("[rank 0] env 0 4 0 29500 0 2") && ta.contains("[rank 1] env 1 4 1 29500 0 2"),
        "{ta}"
    );
    assert!(
        tb.contains("[rank 2] env 2 4 0 29500 1 2") && tb.contains("[rank 3] env 3 4 1 29500 1 2"),
        "{tb}"
    );
}

#[test]
fn ranks_find_the_wheels_nccl_as_libnccl_so() {
    // In a fresh cache the link is made; a stale one (another wheel's) is
    // replaced.
    let cache = std::env::temp_dir().join(format!("zrt-launch-nccl-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&cache);
    let link = cache.join("nccl/libnccl.so");
    for stale in [false, true] {
        if stale {
            std::fs::remove_file(&link).unwrap();
            std::os::unix::fs::symlink("/nonexistent/libnccl.so.2", &link).unwrap();
        }
        let o = zrt()
            .args(["launch", "--nproc-per-node", "1", "--", "sh", "-c"])
            .arg("for d in $(echo $LD_LIBRARY_PATH | tr : ' '); do [ -e $d/libnccl.so ] && echo found $d; done")
            .env("ZRT_CACHE", &cache)
            .output()
            .unwrap();
        let t = text(&o);
        let want = format!("[rank 0] found {}", cache.join("nccl").display());
        assert!(t.contains(&want), "stale link {stale}: {t}");
        let target = std::fs::read_link(&link).unwrap();
        assert!(
            target.ends_with("nvidia/nccl/lib/libnccl.so.2"),
            "{target:?}"
        );
    }
    let _ = std::fs::remove_dir_all(&cache);
}

#[test]
fn a_failing_rank_stops_the_others_and_its_code_is_the_launchers() {
    let t0 = Instant::now();
    let o = zrt()
        .args(["launch", "--nproc-per-node", "3", "--", "sh", "-c"])
        .arg("if [ $RANK = 1 ]; then sleep 0.2; exit 7; fi; sleep 60")
        .output()
        .unwrap();
    assert!(
        t0.elapsed() < Duration::from_secs(10),
        "took {:?}",
        t0.elapsed()
    );
    assert_eq!(o.status.code(), Some(7));
    assert!(
        text(&o).contains("zrt launch: rank 1 exited with code 7; stopping the other 2 rank(s)")
            && !text(&o).contains("restart"),
        "{}",
        text(&o)
    );
    // A rank killed by a signal: the shell's convention, 128 + the signal.
    let o = zrt()
        .args(["launch", "--nproc-per-node", "2", "--", "sh", "-c"])
        .arg("if [ $RANK = 0 ]; then kill -9 $$; fi; sleep 60")
        .output()
        .unwrap();
    let t = text(&o);
    assert_eq!(o.status.code(), Some(137), "{t}");
    assert!(
        t.contains(
            "zrt launch: rank 0 was killed by signal 9 (SIGKILL); stopping the other 1 rank(s)"
        ) && !t.contains("out-of-memory"),
        "{t}"
    );
}

/// The lines `[rank R] attempt A port P` a restart test's ranks printed,
/// as (attempt, rank, port).
fn attempts(t: &str) -> Vec<(u32, usize, u16)> {
    let mut seen: Vec<(u32, usize, u16)> = t
        .lines()
        .filter_map(|l| {
            let w: Vec<&str> = l.split_whitespace().collect();
            match w[..] {
                ["[rank", r, "attempt", a, "port", p] => Some((
                    a.parse().ok()?,
                    r.trim_end_matches(']').parse().ok()?,
                    p.parse().ok()?,
                )),
                _ => None,
            }
        })
        .collect();
    seen.sort();
    seen
}

/// Runs `f` with the path (in shell syntax) of a file one rank of each
/// attempt touches once it has said its line, so that its peer fails only
/// then: `up$TORCHELASTIC_RESTART_COUNT` in a fresh folder.
fn with_handshake<R>(name: &str, f: impl FnOnce(&str) -> R) -> R {
    let dir = scratch(&format!("launch-{name}"));
    let r = f(&format!("{}/up$TORCHELASTIC_RESTART_COUNT", dir.display()));
    let _ = std::fs::remove_dir_all(&dir);
    r
}

/// Shell that waits (at most 30 s) for the file `up`.
fn wait_for(up: &str) -> String {
    format!("i=0; while [ ! -e \"{up}\" ] && [ $i -lt 1500 ]; do sleep 0.02; i=$((i+1)); done")
}

#[test]
fn a_failed_job_starts_again_whole_while_max_restarts_allows() {
    // Rank 1 fails on the first two attempts, rank 0 waiting meanwhile;
    // the third attempt succeeds, and so does the launcher.
    let t0 = Instant::now();
    let o = with_handshake("restarts", |up| {
        zrt()
            .args(["launch", "--nproc-per-node", "2", "--max-restarts", "3"])
            .args(["--", "sh", "-c"])
            .arg(format!(
                "echo attempt $TORCHELASTIC_RESTART_COUNT port $MASTER_PORT; \
                 [ $TORCHELASTIC_MAX_RESTARTS = 3 ] || exit 9; \
                 if [ $TORCHELASTIC_RESTART_COUNT -lt 2 ]; then \
                   if [ $RANK = 1 ]; then {}; exit 3; fi; touch \"{up}\"; sleep 60; fi",
                wait_for(up)
            ))
            .output()
            .unwrap()
    });
    let t = text(&o);
    assert!(o.status.success(), "{t}");
    assert!(
        t0.elapsed() < Duration::from_secs(30),
        "took {:?}",
        t0.elapsed()
    );
    let seen = attempts(&t);
    let who: Vec<(u32, usize)> = seen.iter().map(|&(a, r, _)| (a, r)).collect();
    assert_eq!(who, [(0, 0), (0, 1), (1, 0), (1, 1), (2, 0), (2, 1)], "{t}");
    // Each attempt meets at a rendezvous of its own.
    let ports: std::collections::BTreeSet<u16> = seen.iter().map(|&(_, _, p)| p).collect();
    assert_eq!(ports.len(), 3, "{t}");
    for n in 1..=2 {
        assert!(
            t.contains(&format!(
                "zrt launch: restarting every rank (restart {n} of 3; the ranks see TORCHELASTIC_RESTART_COUNT={n}"
            )),
            "{t}"
        );
    }
    assert_eq!(
        t.matches("zrt launch: rank 1 exited with code 3; stopping the other 1 rank(s)")
            .count(),
        2,
        "{t}"
    );
    assert!(!t.contains("restart 3 of 3"), "{t}");
    assert!(
        t.trim_end()
            .ends_with("zrt launch: every rank ended well after 2 restart(s)"),
        "{t}"
    );
}

#[test]
fn a_job_that_keeps_failing_exits_with_its_code_once_the_restarts_run_out() {
    let o = with_handshake("no-restarts-left", |up| {
        zrt()
            .args(["launch", "--nproc-per-node", "2", "--max-restarts", "2"])
            .args(["--", "sh", "-c"])
            .arg(format!(
                "echo attempt $TORCHELASTIC_RESTART_COUNT port $MASTER_PORT; \
                 if [ $RANK = 0 ]; then {}; exit 5; fi; touch \"{up}\"; sleep 60",
                wait_for(up)
            ))
            .output()
            .unwrap()
    });
    let t = text(&o);
    assert_eq!(o.status.code(), Some(5), "{t}");
    let who: Vec<(u32, usize)> = attempts(&t).iter().map(|&(a, r, _)| (a, r)).collect();
    assert_eq!(who, [(0, 0), (0, 1), (1, 0), (1, 1), (2, 0), (2, 1)], "{t}");
    assert!(
        t.contains("restart 2 of 2")
            && t.trim_end().ends_with(
                "zrt launch: no restarts left (--max-restarts 2 used); exiting with code 5"
            ),
        "{t}"
    );
}

#[test]
fn log_dir_keeps_each_attempts_output_of_each_rank() {
    let logs = std::env::temp_dir().join(format!("zrt-launch-logs-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&logs);
    let o = with_handshake("log-dir-handshake", |up| {
        zrt()
            .args(["launch", "--nproc-per-node", "2", "--max-restarts", "1"])
            .arg("--log-dir")
            .arg(&logs)
            .args(["--", "sh", "-c"])
            .arg(format!(
                "echo out $RANK $TORCHELASTIC_RESTART_COUNT; echo err $RANK >&2; \
                 if [ $TORCHELASTIC_RESTART_COUNT = 0 ]; then \
                   if [ $RANK = 1 ]; then {}; exit 4; fi; touch \"{up}\"; sleep 60; fi",
                wait_for(up)
            ))
            .output()
            .unwrap()
    });
    let t = text(&o);
    assert!(o.status.success(), "{t}");
    // The console keeps its prefixed lines; the files hold the ranks' own.
    assert!(
        t.contains("[rank 1] out 1 0") && t.contains("[rank 1] out 1 1"),
        "{t}"
    );
    for attempt in 0..2 {
        for rank in 0..2 {
            let d = logs.join(format!("attempt_{attempt}/rank_{rank}"));
            let read = |f: &str| std::fs::read_to_string(d.join(f)).unwrap();
            assert_eq!(read("stdout.log"), format!("out {rank} {attempt}\n"), "{t}");
            assert_eq!(read("stderr.log"), format!("err {rank}\n"), "{t}");
        }
    }
    // A folder that cannot be made: refused before any rank starts.
    let file = logs.join("attempt_0/rank_0/stdout.log");
    let o = zrt()
        .args(["launch", "--nproc-per-node", "1", "--log-dir"])
        .arg(&file)
        .args(["--", "sh", "-c", "echo started"])
        .output()
        .unwrap();
    let t = text(&o);
    let _ = std::fs::remove_dir_all(&logs);
    assert!(
        !o.status.success()
            && t.contains(&format!(
                "--log-dir: cannot make {}/attempt_0/rank_0",
                file.display()
            ))
            && !t.contains("started"),
        "{t}"
    );
}

#[test]
fn ctrl_c_ends_a_job_that_may_restart() {
    // The launcher's own signal is the user's decision, not a rank's
    // failure: no attempt follows it.
    // Signalled once both ranks run (they said so).
    let (t, status) = crate::common::signalled_when(
        zrt()
            .args(["launch", "--nproc-per-node", "2", "--max-restarts", "3"])
            .args(["--", "sh", "-c"])
            .arg("echo attempt $TORCHELASTIC_RESTART_COUNT port $MASTER_PORT; sleep 60"),
        libc::SIGINT,
        |said| attempts(said).len() >= 2,
    );
    assert_eq!(status.code(), Some(130), "{t}");
    assert!(
        t.contains("got signal 2, forwarding it to every rank") && !t.contains("restarting"),
        "{t}"
    );
    let who: Vec<(u32, usize)> = attempts(&t).iter().map(|&(a, r, _)| (a, r)).collect();
    assert_eq!(who, [(0, 0), (0, 1)], "{t}");
}

/// Runs two ranks under `zrt launch LAUNCH_ARGS` where rank `failing.0`
/// waits (at most 30 s) for the file `$READY`, then exits with code
/// `failing.1`; the other rank runs `script`, which touches `$READY` once
/// it is set up. Returns the launcher's output.
fn fail_when_ready(
    name: &str,
    launch_args: &[&str],
    failing: (usize, i32),
    script: &str,
    env: &[(&str, &str)],
) -> std::process::Output {
    let ready = std::env::temp_dir().join(format!("zrt-launch-{name}-{}", std::process::id()));
    let _ = std::fs::remove_file(&ready);
    let (rank, code) = failing;
    let o = zrt()
        .args(["launch", "--nproc-per-node", "2"])
        .args(launch_args)
        .args(["--", "sh", "-c"])
        .arg(format!(
            "if [ $RANK = {rank} ]; then i=0; while [ ! -e \"$READY\" ] && [ $i -lt 1500 ]; \
             do sleep 0.02; i=$((i+1)); done; exit {code}; fi; {script}"
        ))
        .env("READY", &ready)
        .envs(env.iter().copied())
        .output()
        .unwrap();
    let _ = std::fs::remove_file(&ready);
    o
}

#[test]
fn stopping_a_rank_signals_what_it_started_too() {
    // Rank 0 is a shell that runs another shell (as a wrapper script runs
    // the real program); only the inner one says it got SIGTERM. Each rank
    // leads a process group and the launcher signals the group.
    let o = fail_when_ready(
        "group",
        &["--grace", "2"],
        (1, 5),
        "trap : TERM; sh -c \"$INNER\" & p=$!; wait $p; wait $p",
        &[(
            "INNER",
            "trap 'echo inner got TERM; exit 0' TERM; touch \"$READY\"; sleep 60 & wait",
        )],
    );
    let t = text(&o);
    assert_eq!(o.status.code(), Some(5), "{t}");
    assert!(t.contains("[rank 0] inner got TERM"), "{t}");
}

#[test]
fn a_rank_that_ignores_sigterm_is_killed_after_its_grace_and_not_before() {
    // Rank 1 ignores SIGTERM (and so does its `sleep`), then tells rank 0,
    // which fails. With a grace longer than rank 1's two seconds of work
    // (30 s, or longer than the clock can count) the launcher waits for it
    // to finish, and no longer; with a short one it kills it.
    for (grace, finished) in [("1e19", true), ("30", true), ("0.1", false)] {
        let o = fail_when_ready(
            &format!("grace-{grace}"),
            &["--grace", grace],
            (0, 3),
            "trap '' TERM; touch \"$READY\"; sleep 2; echo finished",
            &[],
        );
        let t = text(&o);
        assert_eq!(o.status.code(), Some(3), "grace {grace}: {t}");
        assert!(t.contains("zrt launch: rank 0 exited with code 3"), "{t}");
        assert_eq!(
            t.contains("[rank 1] finished"),
            finished,
            "grace {grace}: {t}"
        );
    }
}

/// Whether process `pid` still runs (a zombie, dead but not yet reaped by
/// whoever adopted it, does not).
fn runs(pid: i32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .ok()
        .and_then(|s| {
            let state = s.rsplit_once(") ")?.1.chars().next()?;
            Some(state != 'Z' && state != 'X')
        })
        .unwrap_or(false)
}

#[test]
fn ranks_die_with_a_launcher_killed_by_sigkill() {
    // A scheduler or the OOM killer ends the launcher with SIGKILL, which
    // it cannot forward: its ranks, in their own process groups, must not
    // go on running.
    let pids = std::env::temp_dir().join(format!("zrt-launch-orphans-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&pids);
    std::fs::create_dir_all(&pids).unwrap();
    let mut launcher = zrt()
        .args(["launch", "--nproc-per-node", "2", "--", "sh", "-c"])
        .arg("echo $$ > \"$PIDS/$RANK.tmp\" && mv \"$PIDS/$RANK.tmp\" \"$PIDS/$RANK\" && exec sleep 60")
        .env("PIDS", &pids)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let pid = |r: usize| -> Option<i32> {
        std::fs::read_to_string(pids.join(r.to_string()))
            .ok()?
            .trim()
            .parse()
            .ok()
    };
    let t0 = Instant::now();
    while (pid(0).is_none() || pid(1).is_none()) && t0.elapsed() < Duration::from_secs(30) {
        std::thread::sleep(Duration::from_millis(20));
    }
    let ranks = [pid(0).unwrap(), pid(1).unwrap()];
    assert!(ranks.iter().all(|&p| runs(p)), "{ranks:?}");
    launcher.kill().unwrap();
    launcher.wait().unwrap();
    let t0 = Instant::now();
    while ranks.iter().any(|&p| runs(p)) && t0.elapsed() < Duration::from_secs(10) {
        std::thread::sleep(Duration::from_millis(20));
    }
    let left: Vec<i32> = ranks.into_iter().filter(|&p| runs(p)).collect();
    for &p in &left {
        // SAFETY: killing the test's own orphans so they do not outlive it.
        unsafe { libc::kill(p, libc::SIGKILL) };
    }
    let _ = std::fs::remove_dir_all(&pids);
    assert!(left.is_empty(), "ranks {left:?} outlived their launcher");
}

#[test]
fn ctrl_c_is_forwarded_to_every_rank() {
    // The ranks' `sleep 60` ignores SIGINT (a background job of a
    // non-interactive shell does) and outlives its shell: the launcher
    // kills what is left of each rank's process group when the rank ends.
    let t0 = Instant::now();
    let child = zrt()
        .args(["launch", "--nproc-per-node", "2", "--", "sh", "-c"])
        .arg("trap 'echo got-int; exit 0' INT; echo ready; sleep 60 & wait")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    std::thread::sleep(Duration::from_millis(700));
    // SAFETY: signalling the child we just spawned.
    unsafe { libc::kill(child.id() as libc::pid_t, libc::SIGINT) };
    let o = child.wait_with_output().unwrap();
    let t = text(&o);
    assert_eq!(o.status.code(), Some(130), "{t}");
    assert!(
        t.contains("[rank 0] got-int") && t.contains("[rank 1] got-int"),
        "{t}"
    );
    assert!(
        t0.elapsed() < Duration::from_secs(30),
        "took {:?}",
        t0.elapsed()
    );
}

#[test]
fn launchers_on_two_nodes_make_one_job() {
    // Two "nodes" on this host: each launcher starts one rank, they meet at
    // node 0's store with the shared token, and talk over tcp as two hosts
    // would. The program is the collectives benchmark's rank half, which
    // all-reduces its timings and prints rank 0's as one line.
    let port = free_port();
    let (a, b) = (node(port, 0, 1), node(port, 1, 1));
    let (a, b) = (a.wait_with_output().unwrap(), b.wait_with_output().unwrap());
    let (ta, tb) = (text(&a), text(&b));
    assert!(a.status.success() && b.status.success(), "{ta}\n{tb}");
    assert!(ta.contains("[rank 0] @@zrt {\"results\""), "{ta}");
    assert!(!tb.contains("@@zrt"), "only rank 0 reports: {tb}");
}

#[test]
fn launchers_on_two_nodes_restart_the_job_together() {
    // Node 1's rank fails at once on the first attempt, while node 0's
    // waits for it to join: node 0's launcher stops its rank on node 1's
    // report, and both start the second attempt, whose ranks meet at a
    // fresh store on the same port and run the benchmark.
    let port = free_port();
    let script = "echo attempt $TORCHELASTIC_RESTART_COUNT; \
                  if [ $TORCHELASTIC_RESTART_COUNT = 0 ] && [ $RANK = 1 ]; then exit 3; fi; exec \"$@\"";
    let bench = [env!("CARGO_BIN_EXE_zrt")];
    let restarts = ["--max-restarts", "2"];
    let t0 = Instant::now();
    let (a, b) = (
        node_running(port, 0, 1, &restarts, &bench, script),
        node_running(port, 1, 1, &restarts, &bench, script),
    );
    let (a, b) = (a.wait_with_output().unwrap(), b.wait_with_output().unwrap());
    let (ta, tb) = (text(&a), text(&b));
    assert!(a.status.success() && b.status.success(), "{ta}\n{tb}");
    assert!(t0.elapsed() < Duration::from_secs(60), "{:?}", t0.elapsed());
    assert_eq!(ta.matches("[rank 0] @@zrt {\"results\"").count(), 1, "{ta}");
    assert!(
        ta.contains("zrt launch: node 1's rank 1 failed (code 3); stopping this node's 1 rank(s)"),
        "{ta}"
    );
    assert!(tb.contains("zrt launch: rank 1 exited with code 3"), "{tb}");
    for t in [&ta, &tb] {
        assert!(t.contains("restarting every rank (restart 1 of 2"), "{t}");
        assert!(!t.contains("restart 2 of 2"), "{t}");
        assert!(
            t.contains("zrt launch: every rank ended well after 1 restart(s)"),
            "{t}"
        );
    }
    // Rank 0 may be stopped before it says anything on the first attempt.
    for (t, r, attempt) in [(&ta, 0, 1), (&tb, 1, 0), (&tb, 1, 1)] {
        assert!(t.contains(&format!("[rank {r}] attempt {attempt}")), "{t}");
    }
}

#[test]
fn launchers_on_two_nodes_run_out_of_restarts_together() {
    let port = free_port();
    let script = "if [ $RANK = 0 ]; then exit 6; fi; exec \"$@\"";
    let bench = [env!("CARGO_BIN_EXE_zrt")];
    let restarts = ["--max-restarts", "1"];
    let (a, b) = (
        node_running(port, 0, 1, &restarts, &bench, script),
        node_running(port, 1, 1, &restarts, &bench, script),
    );
    let (a, b) = (a.wait_with_output().unwrap(), b.wait_with_output().unwrap());
    for o in [&a, &b] {
        let t = text(o);
        // Node 1 ends with node 0's rank's code, which it never saw.
        assert_eq!(o.status.code(), Some(6), "{t}");
        assert!(
            t.contains("restart 1 of 1")
                && t.contains(
                    "zrt launch: no restarts left (--max-restarts 1 used); exiting with code 6"
                ),
            "{t}"
        );
    }
}

/// A two-node job at a fresh port with `launch_args`, whose ranks each
/// touch `$DIR/up$RANK` and then run the shell `then`; returned once both
/// ranks are up: the folder `$DIR` (the test removes it), the port and the
/// two launchers.
fn two_nodes_up(
    name: &str,
    launch_args: &[&str],
    then: &str,
) -> (
    std::path::PathBuf,
    u16,
    std::process::Child,
    std::process::Child,
) {
    let port = free_port();
    let dir = scratch(&format!("launch-agents-{name}"));
    let script = format!("DIR=\"{}\"; touch \"$DIR/up$RANK\"; {then}", dir.display());
    let (a, b) = (
        node_running(port, 0, 1, launch_args, &[], &script),
        node_running(port, 1, 1, launch_args, &[], &script),
    );
    let t0 = Instant::now();
    while !(dir.join("up0").exists() && dir.join("up1").exists()) {
        assert!(
            t0.elapsed() < Duration::from_secs(30),
            "the ranks never started"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    (dir, port, a, b)
}

#[test]
fn a_signal_to_one_nodes_launcher_ends_every_node_without_restarting() {
    let (dir, _, a, b) = two_nodes_up("int", &["--max-restarts", "3"], "sleep 60");
    // SAFETY: kill(2) on our own child.
    unsafe { libc::kill(b.id() as libc::pid_t, libc::SIGINT) };
    let (a, b) = (a.wait_with_output().unwrap(), b.wait_with_output().unwrap());
    let _ = std::fs::remove_dir_all(&dir);
    let (ta, tb) = (text(&a), text(&b));
    assert_eq!(b.status.code(), Some(130), "{tb}");
    assert_eq!(a.status.code(), Some(130), "{ta}");
    assert!(
        ta.contains("zrt launch: node 1's launcher got signal 2; stopping this node's 1 rank(s)"),
        "{ta}"
    );
    for t in [&ta, &tb] {
        assert!(!t.contains("restarting"), "{t}");
    }
}

#[test]
fn a_launcher_that_dies_ends_the_other_nodes_job_at_once_naming_it() {
    // Node 1's launcher is killed outright (its rank dies with it) while
    // node 0's rank sleeps, as a rank waiting for its peers in a
    // rendezvous would until its timeout: node 0's launcher stops it and
    // ends the job, restarts or not (they would need node 1).
    let (dir, _, a, mut b) = two_nodes_up("kill", &["--max-restarts", "3"], "sleep 60");
    b.kill().unwrap();
    let _ = b.wait();
    let t1 = Instant::now();
    let o = a.wait_with_output().unwrap();
    let _ = std::fs::remove_dir_all(&dir);
    let t = text(&o);
    assert_eq!(o.status.code(), Some(1), "{t}");
    assert!(t1.elapsed() < Duration::from_secs(30), "{:?}", t1.elapsed());
    assert!(
        t.contains("zrt launch: node 1's launcher ended (it exited, was stopped or died) while the ranks of attempt 0 ran: every node's launcher runs until the job ends; its own output says why; stopping this node's 1 rank(s)"),
        "{t}"
    );
    assert!(!t.contains("restarting"), "{t}");
}

#[test]
fn a_launcher_that_dies_while_the_others_wait_for_its_ranks_is_named() {
    // Node 0's rank ends well; node 1's launcher is killed while node 0's
    // waits for node 1's rank to end (once node 0's launcher has reaped
    // its rank: before, it would still be watching its ranks run).
    let then = "echo $$ > \"$DIR/pid$RANK\"; if [ $RANK = 1 ]; then sleep 60; fi";
    let (dir, _, a, mut b) = two_nodes_up("finish", &[], then);
    let t0 = Instant::now();
    let pid0 = loop {
        let pid = std::fs::read_to_string(dir.join("pid0")).unwrap_or_default();
        if let Ok(pid) = pid.trim().parse::<u32>() {
            break pid;
        }
        assert!(t0.elapsed() < Duration::from_secs(30), "no pid from rank 0");
        std::thread::sleep(Duration::from_millis(10));
    };
    while std::path::Path::new(&format!("/proc/{pid0}")).exists() {
        assert!(
            t0.elapsed() < Duration::from_secs(30),
            "rank 0 never reaped"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    b.kill().unwrap();
    let _ = b.wait();
    let t1 = Instant::now();
    let o = a.wait_with_output().unwrap();
    let _ = std::fs::remove_dir_all(&dir);
    let t = text(&o);
    assert!(!o.status.success(), "{t}");
    assert!(t1.elapsed() < Duration::from_secs(30), "{:?}", t1.elapsed());
    assert!(
        t.contains("node 1's launcher ended (it exited, was stopped or died) while this one waited for the other nodes' ranks of attempt 0 to end"),
        "{t}"
    );
}

#[test]
fn a_node_whose_program_cannot_start_ends_the_job_on_every_node() {
    // Each node in turn is given a program that does not exist, while the
    // other's rank sleeps as one waiting for its peers would: that node's
    // launcher says why to the others, which stop their ranks and end too.
    for bad in [0, 1] {
        let port = free_port();
        let missing = "/nonexistent/zrt-test-program";
        let t0 = Instant::now();
        let [a, b] = [0, 1].map(|n| match n == bad {
            true => node_running(port, n, 1, &["--max-restarts", "2"], &[missing], ""),
            false => node_running(port, n, 1, &["--max-restarts", "2"], &[], "sleep 60"),
        });
        let (a, b) = (a.wait_with_output().unwrap(), b.wait_with_output().unwrap());
        assert!(t0.elapsed() < Duration::from_secs(30), "{:?}", t0.elapsed());
        let (bad_o, good_o) = match bad {
            0 => (a, b),
            _ => (b, a),
        };
        let (tb, tg) = (text(&bad_o), text(&good_o));
        assert!(!bad_o.status.success(), "{tb}");
        assert!(
            tb.contains(&format!("cannot start `{missing}` for rank {bad}")),
            "{tb}"
        );
        assert_eq!(good_o.status.code(), Some(1), "{tg}");
        assert!(
            tg.contains(&format!(
                "zrt launch: node {bad}'s launcher could not start its ranks (cannot start `{missing}` for rank {bad}: "
            )) && tg.contains("stopping this node's 1 rank(s)"),
            "{tg}"
        );
        for t in [&tb, &tg] {
            assert!(!t.contains("restarting"), "{t}");
        }
    }
}

#[test]
fn a_failing_rank_on_one_node_stops_every_node_with_its_code() {
    // No restarts: node 0's rank would sleep on, as one whose peer died
    // outside any collective does; its launcher stops it on node 1's
    // report and ends with node 1's rank's code, naming it.
    let port = free_port();
    let script = "if [ $RANK = 1 ]; then exit 5; fi; sleep 60";
    let t1 = Instant::now();
    let [a, b] = [0, 1].map(|n| node_running(port, n, 1, &[], &[], script));
    let (a, b) = (a.wait_with_output().unwrap(), b.wait_with_output().unwrap());
    assert!(t1.elapsed() < Duration::from_secs(30), "{:?}", t1.elapsed());
    let (ta, tb) = (text(&a), text(&b));
    assert_eq!(a.status.code(), Some(5), "{ta}");
    assert_eq!(b.status.code(), Some(5), "{tb}");
    assert!(
        ta.contains("zrt launch: node 1's rank 1 failed (code 5); stopping this node's 1 rank(s)"),
        "{ta}"
    );
    assert!(tb.contains("zrt launch: rank 1 exited with code 5"), "{tb}");
    for t in [&ta, &tb] {
        assert!(!t.contains("no restarts left"), "{t}");
    }
}

#[test]
fn a_second_launcher_given_a_node_rank_in_use_is_refused_alone() {
    // The job's ranks run until the test has seen the second launcher go.
    let then = "while [ ! -e \"$DIR/go\" ]; do sleep 0.02; done";
    let restarts = ["--max-restarts", "1"];
    let (dir, port, a, b) = two_nodes_up("twice", &restarts, then);
    let c = node_running(port, 1, 1, &restarts, &[], "true")
        .wait_with_output()
        .unwrap();
    std::fs::write(dir.join("go"), "").unwrap();
    let (a, b) = (a.wait_with_output().unwrap(), b.wait_with_output().unwrap());
    let _ = std::fs::remove_dir_all(&dir);
    let t = text(&c);
    assert!(
        !c.status.success()
            && t.contains("another launcher already runs node 1 of this job (--node-rank 1)"),
        "{t}"
    );
    for o in [&a, &b] {
        assert!(o.status.success(), "{}", text(o));
    }
}

#[test]
fn launchers_given_different_restarts_stop_naming_both() {
    let port = free_port();
    let (a, b) = (
        node_running(port, 0, 1, &["--max-restarts", "1"], &["true"], ""),
        node_running(port, 1, 1, &["--max-restarts", "2"], &["true"], ""),
    );
    let (a, b) = (a.wait_with_output().unwrap(), b.wait_with_output().unwrap());
    for o in [&a, &b] {
        let t = text(o);
        assert!(!o.status.success(), "{t}");
        assert!(
            t.contains("node 1's launcher was given --nnodes 2 --nproc-per-node 1 --max-restarts 2, node 0's --nnodes 2 --nproc-per-node 1 --max-restarts 1: give every node's launcher the same"),
            "{t}"
        );
    }
}

#[test]
fn launchers_given_different_sizes_stop_at_once_naming_the_mistake() {
    // Node 0's launcher is told one rank per node, node 1's two: rank 0
    // would run a world of 2, ranks 2 and 3 a world of 4, and rank 0 once
    // waited out its whole timeout for a rank 1 that never came. The
    // launchers compare their settings before starting any rank (the
    // ranks' own check, for ranks other launchers start, is
    // `rendezvous`'s).
    let port = free_port();
    let t = Instant::now();
    let (a, b) = (node(port, 0, 1), node(port, 1, 2));
    let (a, b) = (a.wait_with_output().unwrap(), b.wait_with_output().unwrap());
    let took = t.elapsed();
    for o in [&a, &b] {
        let t = text(o);
        assert!(!o.status.success(), "{t}");
        assert!(
            t.contains("node 1's launcher was given --nnodes 2 --nproc-per-node 2 --max-restarts 0, node 0's --nnodes 2 --nproc-per-node 1 --max-restarts 0: give every node's launcher the same --nnodes, --nproc-per-node and --max-restarts"),
            "{t}"
        );
        assert!(!t.contains("[rank "), "no rank started: {t}");
    }
    assert!(took < Duration::from_secs(30), "{took:?}");
}

/// An elastic node's launcher (`--nnodes 1:2`, `--last-call 0.5`) at
/// `port`, named `rank`, with `launch_args`, one rank running
/// `sh -c SCRIPT` (ranks see each other's files only).
fn elastic_node(
    port: u16,
    rank: usize,
    nnodes: &str,
    launch_args: &[&str],
    script: &str,
) -> std::process::Child {
    zrt()
        .args([
            "launch",
            "--nnodes",
            nnodes,
            "--node-rank",
            &rank.to_string(),
        ])
        .args(["--nproc-per-node", "1", "--master-addr", "127.0.0.1"])
        .args(["--master-port", &port.to_string(), "--last-call", "0.5"])
        .args(launch_args)
        .args(["--", "sh", "-c", script])
        .env("ZRT_TOKEN", "0123456789abcdef0123456789abcdef")
        .env("ZRT_TIMEOUT", "30")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap()
}

/// The shell line an elastic test's ranks say first.
const SAY_PLACE: &str = "echo \"at $TORCHELASTIC_RESTART_COUNT world $WORLD_SIZE rank $RANK group $GROUP_RANK/$GROUP_WORLD_SIZE\"";

/// Waits until `f` exists (a rank's handshake), at most 30 s.
fn wait_for_file(f: &std::path::Path) {
    let t0 = Instant::now();
    while !f.exists() {
        assert!(
            t0.elapsed() < Duration::from_secs(30),
            "{} never came",
            f.display()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn an_elastic_job_starts_with_the_nodes_it_has_and_restarts_when_one_joins() {
    // Node 0 starts alone (1 of 1:2 after the last call); node 1 comes
    // later: node 0's rank is stopped and both start the next attempt
    // as a world of 2, with no restart used (--max-restarts 0).
    let dir = scratch("elastic-join");
    let script = format!(
        "{SAY_PLACE}; if [ $WORLD_SIZE = 1 ]; then touch {}/alone; sleep 60; fi",
        dir.display()
    );
    let port = free_port();
    let a = elastic_node(port, 0, "1:2", &[], &script);
    wait_for_file(&dir.join("alone"));
    let b = elastic_node(port, 1, "1:2", &[], &script);
    let (a, b) = (a.wait_with_output().unwrap(), b.wait_with_output().unwrap());
    let _ = std::fs::remove_dir_all(&dir);
    let (ta, tb) = (text(&a), text(&b));
    assert!(a.status.success() && b.status.success(), "{ta}\n{tb}");
    assert!(
        ta.contains("[rank 0] at 0 world 1 rank 0 group 0/1"),
        "{ta}"
    );
    assert!(
        ta.contains("zrt launch: a node's launcher waits to join the job; every node starts attempt 1 with it"),
        "{ta}"
    );
    assert!(
        ta.contains("[rank 0] at 0 world 2 rank 0 group 0/2"),
        "{ta}"
    );
    assert!(
        tb.contains("[rank 1] at 0 world 2 rank 1 group 1/2"),
        "{tb}"
    );
    for t in [&ta, &tb] {
        assert!(
            !t.contains("restarting every rank") && !t.contains("restart(s)"),
            "{t}"
        );
    }
    assert!(
        tb.contains("zrt launch: the job runs attempt 0; this node waits to join attempt 1"),
        "{tb}"
    );
}

#[test]
fn an_elastic_job_goes_on_without_a_node_that_dies_and_takes_it_back() {
    // Two nodes run; node 1's launcher is killed outright: node 0
    // restarts alone (a restart used), then node 1 comes back (a new
    // launcher, the same --node-rank) and both run the third attempt.
    let dir = scratch("elastic-back");
    let d = dir.display();
    let script = format!(
        "{SAY_PLACE}; case $TORCHELASTIC_RESTART_COUNT/$WORLD_SIZE in \
           0/2) touch {d}/two$RANK; sleep 60;; \
           1/1) touch {d}/alone; sleep 60;; esac"
    );
    let restarts = ["--max-restarts", "1"];
    let port = free_port();
    let a = elastic_node(port, 0, "1:2", &restarts, &script);
    let mut b = elastic_node(port, 1, "1:2", &restarts, &script);
    wait_for_file(&dir.join("two0"));
    wait_for_file(&dir.join("two1"));
    b.kill().unwrap();
    let _ = b.wait();
    wait_for_file(&dir.join("alone"));
    let c = elastic_node(port, 1, "1:2", &restarts, &script);
    let (a, c) = (a.wait_with_output().unwrap(), c.wait_with_output().unwrap());
    let _ = std::fs::remove_dir_all(&dir);
    let (ta, tc) = (text(&a), text(&c));
    assert!(a.status.success() && c.status.success(), "{ta}\n{tc}");
    let said: Vec<&str> = ta
        .lines()
        .filter(|l| l.starts_with("[rank 0] at "))
        .collect();
    assert_eq!(
        said,
        [
            "[rank 0] at 0 world 2 rank 0 group 0/2",
            "[rank 0] at 1 world 1 rank 0 group 0/1",
            "[rank 0] at 1 world 2 rank 0 group 0/2"
        ],
        "{ta}"
    );
    assert!(
        ta.contains("node 1's launcher ended (it exited, was stopped or died) while the ranks of attempt 0 ran: the others go on without it while at least 1 node(s) remain"),
        "{ta}"
    );
    assert!(ta.contains("restarting every rank (restart 1 of 1"), "{ta}");
    assert!(
        tc.contains("[rank 1] at 1 world 2 rank 1 group 1/2"),
        "{tc}"
    );
    for t in [&ta, &tc] {
        assert!(
            t.contains("every rank ended well after 1 restart(s)"),
            "{t}"
        );
    }
}

/// Once `waiter`, a third elastic launcher, says it waits to join attempt
/// 2, gives the running nodes `a` and `b` time to restart for it if they
/// would (they poll every 20 ms: a restart would show in their lines),
/// lets their ranks end (`dir/go`), checks that all three launchers ended
/// well and returns what each said (`dir` removed).
fn with_a_waiter(
    a: std::process::Child,
    b: std::process::Child,
    mut waiter: std::process::Child,
    dir: &std::path::Path,
) -> (String, String, String) {
    let mut err = std::io::BufReader::new(waiter.stderr.take().unwrap());
    let mut tw = String::new();
    while !tw.contains("this node waits to join attempt 2") {
        let n = std::io::BufRead::read_line(&mut err, &mut tw).unwrap();
        assert!(n > 0, "the waiting node ended: {tw}");
    }
    std::thread::sleep(Duration::from_millis(300));
    std::fs::write(dir.join("go"), "").unwrap();
    std::io::Read::read_to_string(&mut err, &mut tw).unwrap();
    let (a, b, waiter) = (
        a.wait_with_output().unwrap(),
        b.wait_with_output().unwrap(),
        waiter.wait_with_output().unwrap(),
    );
    let _ = std::fs::remove_dir_all(dir);
    let (ta, tb) = (text(&a), text(&b));
    tw.push_str(&text(&waiter));
    assert!(
        a.status.success() && b.status.success() && waiter.status.success(),
        "{ta}\n{tb}\n{tw}"
    );
    (ta, tb, tw)
}

#[test]
fn a_node_joining_after_another_nodes_ranks_finished_restarts_nobody() {
    // 1:3: node 0 starts alone, node 1 joins (both restart as a world of
    // 2); node 0's rank then ends well while node 1's still runs. Node 2
    // arriving now must not restart the job, whose finished ranks would
    // run again: it waits, and is told when the job ends.
    let dir = scratch("elastic-late");
    let d = dir.display();
    let script = format!(
        "{SAY_PLACE}; case $WORLD_SIZE/$GROUP_RANK in \
           1/*) touch {d}/alone; sleep 60;; \
           2/0) touch {d}/done0;; \
           *) touch {d}/up$GROUP_RANK; while [ ! -e {d}/go ]; do sleep 0.02; done;; esac"
    );
    let port = free_port();
    let a = elastic_node(port, 0, "1:3", &[], &script);
    wait_for_file(&dir.join("alone"));
    let b = elastic_node(port, 1, "1:3", &[], &script);
    wait_for_file(&dir.join("done0"));
    wait_for_file(&dir.join("up1"));
    let late = elastic_node(port, 2, "1:3", &[], &script);
    let (ta, tb, tl) = with_a_waiter(a, b, late, &dir);
    let said: Vec<&str> = (ta.lines())
        .filter(|l| l.starts_with("[rank 0] at "))
        .collect();
    assert_eq!(
        said,
        [
            "[rank 0] at 0 world 1 rank 0 group 0/1",
            "[rank 0] at 0 world 2 rank 0 group 0/2"
        ],
        "{ta}"
    );
    assert_eq!(tb.matches("[rank 1] at ").count(), 1, "{tb}");
    assert!(!tl.contains("[rank"), "the late node never ran: {tl}");
    assert!(
        tl.contains("the job ended before this node could join it"),
        "{tl}"
    );
}

#[test]
fn an_elastic_jobs_spare_node_waits_and_is_told_when_the_job_ends() {
    // 1:2 with three launchers: the first two run, the third waits as a
    // spare without restarting them, and ends when the job does.
    let dir = scratch("elastic-spare");
    let d = dir.display();
    let script =
        format!("{SAY_PLACE}; touch {d}/up$GROUP_RANK; while [ ! -e {d}/go ]; do sleep 0.02; done");
    let port = free_port();
    let a = elastic_node(port, 0, "1:2", &[], &script);
    wait_for_file(&dir.join("up0"));
    let b = elastic_node(port, 1, "1:2", &[], &script);
    wait_for_file(&dir.join("up1"));
    let spare = elastic_node(port, 2, "1:2", &[], &script);
    let (ta, _, ts) = with_a_waiter(a, b, spare, &dir);
    assert_eq!(ta.matches("[rank 0] at ").count(), 2, "{ta}");
    assert!(
        ta.contains("[rank 0] at 0 world 2 rank 0 group 0/2"),
        "{ta}"
    );
    assert!(!ts.contains("[rank"), "the spare never ran: {ts}");
    assert!(
        ts.contains("the job ended before this node could join it"),
        "{ts}"
    );
}

#[test]
fn an_elastic_job_short_of_its_minimum_says_whom_it_waits_for() {
    let t0 = Instant::now();
    let o = zrt()
        .args(["launch", "--nnodes", "2:3", "--nproc-per-node", "1"])
        .args(["--master-port", &free_port().to_string(), "--", "true"])
        .env("ZRT_TOKEN", "0123456789abcdef0123456789abcdef")
        .env("ZRT_TIMEOUT", "2")
        .output()
        .unwrap();
    let t = text(&o);
    assert!(!o.status.success(), "{t}");
    assert!(t0.elapsed() < Duration::from_secs(20), "{:?}", t0.elapsed());
    assert!(
        t.contains("waited 2 s for at least 2 node(s)' launchers to join attempt 0 (ZRT_TIMEOUT)"),
        "{t}"
    );
    // Two launchers both left at --node-rank 0: the second cannot serve
    // and is told what elastic node ranks are.
    let dir = scratch("elastic-twice");
    let port = free_port();
    let first = format!("touch {}/up; sleep 5", dir.display());
    let a = elastic_node(port, 0, "1:2", &[], &first);
    wait_for_file(&dir.join("up"));
    let o = elastic_node(port, 0, "1:2", &[], "true")
        .wait_with_output()
        .unwrap();
    let t = text(&o);
    let _ = a.wait_with_output();
    let _ = std::fs::remove_dir_all(&dir);
    assert!(
        !o.status.success()
            && t.contains("in an elastic job give --node-rank 0 to the launcher at MASTER_ADDR only, and each other one a number of its own"),
        "{t}"
    );
    let o = zrt()
        .args(["launch", "--nnodes", "1:2", "--nproc-per-node", "1"])
        .args(["--last-call=-1", "--", "true"])
        .env("ZRT_TOKEN", "0123456789abcdef0123456789abcdef")
        .output()
        .unwrap();
    let t = text(&o);
    assert!(
        !o.status.success() && t.contains("--last-call -1 must be a number of seconds, 0 or more"),
        "{t}"
    );
}

/// Node `rank` of a two-node job at `port` on this host, starting `nproc`
/// ranks of the collectives benchmark over tcp (60 s timeout).
fn node(port: u16, rank: usize, nproc: usize) -> std::process::Child {
    node_running(port, rank, nproc, &[], &[env!("CARGO_BIN_EXE_zrt")], "")
}

/// Node `rank` of a two-node job at `port` on this host, with
/// `launch_args`, starting `nproc` ranks of `program`; each rank runs
/// `sh -c SCRIPT` first when `script` is given, the program being `"$@"`
/// there (tcp backend, 60 s timeout).
fn node_running(
    port: u16,
    rank: usize,
    nproc: usize,
    launch_args: &[&str],
    program: &[&str],
    script: &str,
) -> std::process::Child {
    let mut c = zrt();
    c.args(["launch", "--nnodes", "2", "--node-rank", &rank.to_string()])
        .args(["--nproc-per-node", &nproc.to_string()])
        .args(["--master-addr", "127.0.0.1"])
        .args(launch_args)
        .args(["--master-port", &port.to_string(), "--"]);
    if !script.is_empty() {
        c.args(["sh", "-c", script, "sh"]);
    }
    c.args(program)
        .args(["bench", "collectives-rank", "--sizes", "1", "--iters", "1"])
        .env("ZRT_TOKEN", "0123456789abcdef0123456789abcdef")
        .env("ZRT_BACKEND", "tcp")
        .env("ZRT_TIMEOUT", "60")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap()
}

/// The ports [`free_port`] handed out in this process: each test's
/// launchers listen on its port and the one above, and two tests that
/// drew neighbouring ports at once both found them free before either
/// listened (2026-12-03, a fresh-clone CI run: one node's launcher found
/// `MASTER_PORT + 1` taken, and the test beside it waited in vain).
static HANDED: std::sync::Mutex<Vec<u16>> = std::sync::Mutex::new(Vec::new());

/// A port nothing listens on, nor on the port above (the launchers' own
/// store on several nodes), for a store the test's launchers start:
/// below the ephemeral range, as `zrt launch` picks one, so no listener a
/// concurrent test binds to port 0 can take it before the launchers do;
/// and neither is a port this process handed out or the one above it.
fn free_port() -> u16 {
    let mut handed = HANDED.lock().unwrap_or_else(|e| e.into_inner());
    loop {
        let p = zrt::collectives::store::free_store_port("127.0.0.1").unwrap();
        let near = handed.iter().any(|&q| p.abs_diff(q) <= 1);
        if !near && std::net::TcpListener::bind(("127.0.0.1", p + 1)).is_ok() {
            handed.push(p);
            return p;
        }
    }
}

/// A folder holding a hostfile of `hosts` and a stand-in for ssh that
/// runs the remote command here, through a shell as sshd does (after
/// `before`, shell run with the host in `$host`); and `zrt launch
/// --hostfile` on it at a fresh port, tcp between the ranks. The test
/// removes the folder.
fn hostfile_job(name: &str, hosts: &str, before: &str) -> (std::path::PathBuf, Command) {
    use std::os::unix::fs::PermissionsExt;
    let dir = scratch(&format!("hostfile-{name}"));
    let ssh = dir.join("fake-ssh");
    std::fs::write(
        &ssh,
        format!("#!/bin/sh\nhost=$1; shift\n{before}\nexec sh -c \"$*\"\n"),
    )
    .unwrap();
    std::fs::set_permissions(&ssh, std::fs::Permissions::from_mode(0o755)).unwrap();
    std::fs::write(dir.join("hosts"), hosts).unwrap();
    let mut c = zrt();
    c.args(["launch", "--hostfile"])
        .arg(dir.join("hosts"))
        .args(["--master-port", &free_port().to_string()])
        .env("ZRT_SSH", &ssh)
        .env("ZRT_BACKEND", "tcp")
        .env("ZRT_TIMEOUT", "60");
    (dir, c)
}

#[test]
fn a_hostfile_starts_every_nodes_launcher_from_one_command() {
    // The second host is reached through the stand-in ssh: its ranks get
    // the contract, the token (never on a command line), the program's
    // words as given, and the passed-on environment; then the
    // collectives benchmark's ranks meet over tcp across the two nodes.
    let (dir, mut c) = hostfile_job(
        "one",
        "# the job\n127.0.0.1 slots=2\nnode-b slots=2  # second\n",
        "echo \"ssh to $host\" >&2",
    );
    let o = c
        .args(["--", "sh", "-c"])
        .arg(
            "echo \"env $RANK $WORLD_SIZE $LOCAL_RANK $GROUP_RANK $MASTER_ADDR ${#ZRT_TOKEN} $ZRT_PASSED [$0] [$1]\"; shift; exec \"$@\"",
        )
        .args(["it's a b", "$HOME `x`", env!("CARGO_BIN_EXE_zrt")])
        .args(["bench", "collectives-rank", "--sizes", "1", "--iters", "1"])
        .env("ZRT_PASSED", "yes it is")
        .output()
        .unwrap();
    let _ = std::fs::remove_dir_all(&dir);
    let t = text(&o);
    assert!(o.status.success(), "{t}");
    assert!(t.contains("ssh to node-b"), "{t}");
    for (rank, local, node) in [(0, 0, 0), (1, 1, 0), (2, 0, 1), (3, 1, 1)] {
        let want = format!(
            "[rank {rank}] env {rank} 4 {local} {node} 127.0.0.1 32 yes it is [it's a b] [$HOME `x`]"
        );
        assert!(t.contains(&want), "{want}\n{t}");
    }
    assert_eq!(t.matches("[rank 0] @@zrt {\"results\"").count(), 1, "{t}");
}

#[test]
fn a_host_ssh_cannot_reach_ends_the_job_naming_it() {
    // ssh exits 255 for a host it cannot reach, before that node's
    // launcher ever joins: the head's ranks, which would wait for that
    // node's in their rendezvous, are stopped, and the host is named.
    let (dir, mut c) = hostfile_job(
        "unreachable",
        "127.0.0.1 slots=1\nnode-b slots=1\n",
        "echo \"ssh: connect to host $host port 22: No route to host\" >&2; exit 255",
    );
    let t0 = Instant::now();
    let o = c.args(["--", "sleep", "60"]).output().unwrap();
    let _ = std::fs::remove_dir_all(&dir);
    let t = text(&o);
    assert!(!o.status.success(), "{t}");
    assert!(t0.elapsed() < Duration::from_secs(30), "{:?}", t0.elapsed());
    assert!(
        t.contains("ssh: connect to host node-b port 22: No route to host"),
        "{t}"
    );
    assert!(
        t.contains("node 1's launcher on node-b, started over ssh, ended with code 255 before joining the job"),
        "{t}"
    );
}

#[test]
fn ctrl_c_to_a_hostfiles_launcher_ends_every_nodes_ranks() {
    // The remote rank records its pid; after a Ctrl-C to the head
    // launcher (whose terminal it is), no rank runs on either node.
    let (dir, mut c) = hostfile_job("int", "127.0.0.1 slots=1\nnode-b slots=1\n", "");
    let pids = dir.join("pids");
    std::fs::create_dir_all(&pids).unwrap();
    c.args(["--", "sh", "-c"]).arg(format!(
        "echo $$ > {}/$RANK; echo up; sleep 60",
        pids.display()
    ));
    let (t, status) = crate::common::signalled_when(&mut c, libc::SIGINT, |said| {
        said.contains("[rank 0] up") && said.contains("[rank 1] up")
    });
    let ranks: Vec<i32> = (0..2)
        .map(|r| {
            std::fs::read_to_string(pids.join(r.to_string()))
                .unwrap()
                .trim()
                .parse()
                .unwrap()
        })
        .collect();
    let _ = std::fs::remove_dir_all(&dir);
    assert_eq!(status.code(), Some(130), "{t}");
    assert!(
        t.contains("zrt launch: node 0's launcher got signal 2; stopping this node's 1 rank(s)"),
        "{t}"
    );
    for pid in ranks {
        assert!(!runs(pid), "rank pid {pid} still runs\n{t}");
    }
}

#[test]
fn a_rank_failing_on_a_remote_node_gives_the_head_its_code() {
    let (dir, mut c) = hostfile_job("code", "127.0.0.1 slots=1\nnode-b slots=1\n", "");
    let o = c
        .args([
            "--",
            "sh",
            "-c",
            "if [ $RANK = 1 ]; then exit 7; fi; sleep 60",
        ])
        .output()
        .unwrap();
    let _ = std::fs::remove_dir_all(&dir);
    let t = text(&o);
    assert_eq!(o.status.code(), Some(7), "{t}");
    assert!(
        t.contains("zrt launch: node 1's rank 1 failed (code 7); stopping this node's 1 rank(s)"),
        "{t}"
    );
}

#[test]
fn hostfile_mistakes_are_refused_before_any_node_starts() {
    let (dir, _) = hostfile_job("bad", "192.0.2.1 slots=1\nnode-b slots=1\n", "");
    let hosts = dir.join("hosts").display().to_string();
    let cases: [(&[&str], &str); 4] = [
        (
            &["--hostfile", &hosts, "--", "true"],
            "192.0.2.1, is not this machine (",
        ),
        (
            &["--hostfile", "/nonexistent/hosts", "--", "true"],
            "reading the hostfile /nonexistent/hosts",
        ),
        (
            &["--hostfile", &hosts, "--nnodes", "2", "--", "true"],
            "cannot be used with",
        ),
        (&["--", "true"], "--nproc-per-node N is needed"),
    ];
    for (args, want) in cases {
        let o = zrt()
            .arg("launch")
            .args(args)
            .env("ZRT_SSH", "/nonexistent/ssh")
            .output()
            .unwrap();
        let t = text(&o);
        assert!(!o.status.success() && t.contains(want), "{args:?}: {t}");
        assert!(!t.contains("[rank"), "{t}");
    }
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn bad_arguments_are_refused_with_the_fix() {
    let cases: [(&[&str], &[&str]); 10] = [
        (
            &[
                "--nproc-per-node",
                "2",
                "--nnodes",
                "2",
                "--node-rank",
                "1",
                "--",
                "true",
            ],
            &["needs the same ZRT_TOKEN on every node"],
        ),
        (
            &[
                "--nproc-per-node",
                "2",
                "--nnodes",
                "2",
                "--node-rank",
                "2",
                "--",
                "true",
            ],
            &["--node-rank 2 must be below --nnodes 2"],
        ),
        (
            &["--nproc-per-node", "1", "--", "/nonexistent/prog"],
            &["cannot start `/nonexistent/prog` for rank 0"],
        ),
        // An address of no interface here (TEST-NET-1): the address is the
        // problem, not the ports.
        (
            &[
                "--nproc-per-node",
                "1",
                "--master-addr",
                "192.0.2.1",
                "--",
                "true",
            ],
            &[
                "cannot listen on 192.0.2.1: ",
                "the master address must name this host",
            ],
        ),
        (
            &["--nproc-per-node", "0", "--", "true"],
            &["--nproc-per-node and --nnodes must be at least 1"],
        ),
        (
            &["--nproc-per-node", "1", "--nnodes", "0", "--", "true"],
            &["--nproc-per-node and --nnodes must be at least 1"],
        ),
        (
            &["--nproc-per-node", "2", "--master-port", "0", "--", "true"],
            &["--master-port 0 names no port the ranks could meet on"],
        ),
        (
            &["--nproc-per-node", "1", "--grace=-1", "--", "true"],
            &["--grace -1 must be a number of seconds, 0 or more"],
        ),
        (
            &["--nproc-per-node", "1", "--grace", "NaN", "--", "true"],
            &["--grace NaN must be a number of seconds, 0 or more"],
        ),
        // Refused before the token is asked for: the port is the mistake
        // to mend first.
        (
            &[
                "--nproc-per-node",
                "1",
                "--nnodes",
                "2",
                "--master-port",
                "65535",
                "--",
                "true",
            ],
            &["--master-port 65535 leaves no port above it for the launchers' own store"],
        ),
    ];
    for (args, want) in cases {
        let o = zrt().arg("launch").args(args).output().unwrap();
        let t = text(&o);
        assert!(!o.status.success(), "{args:?}: {t}");
        for w in want {
            assert!(t.contains(w), "{args:?}: {t}");
        }
    }
}

#[test]
fn lines_of_ranks_writing_at_once_to_one_file_stay_whole() {
    // stdout and stderr of the launcher are one file, as under `2>&1`:
    // every rank's line must reach it whole, never cut by another's.
    let path = std::env::temp_dir().join(format!("zrt-launch-lines-{}", std::process::id()));
    let out = std::fs::File::create(&path).unwrap();
    let status = zrt()
        .args(["launch", "--nproc-per-node", "3", "--", "sh", "-c"])
        .arg("i=0; while [ $i -lt 300 ]; do echo out $RANK $i; echo err $RANK $i >&2; i=$((i+1)); done")
        // Set, so the file holds the ranks' lines only (the launcher's
        // own line about it is tested above).
        .env("OMP_NUM_THREADS", "1")
        .stdout(Stdio::from(out.try_clone().unwrap()))
        .stderr(Stdio::from(out))
        .status()
        .unwrap();
    let t = std::fs::read_to_string(&path).unwrap();
    let _ = std::fs::remove_file(&path);
    assert!(status.success(), "{t}");
    let mut lines = 0;
    for line in t.lines() {
        let ok = (0..3).any(|r| {
            ["out", "err"].iter().any(|s| {
                line.strip_prefix(&format!("[rank {r}] {s} {r} "))
                    .is_some_and(|i| i.parse::<u32>().is_ok())
            })
        });
        assert!(ok, "a cut line: {line:?}");
        lines += 1;
    }
    assert_eq!(lines, 3 * 2 * 300, "{t}");
}

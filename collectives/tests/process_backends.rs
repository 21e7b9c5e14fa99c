//! The process backends (shared memory and TCP on loopback) with real
//! processes: this test binary re-runs itself once per rank (the `rank_main`
//! test, which does nothing unless `ZRT_TEST_SCENARIO` is set), with the
//! environment `zrt launch` sets. Every scenario runs on both backends.
//!
//! The local backend's tests are a module of this binary
//! (`local_backend::`), not a binary of their own: one link of the crate
//! fewer in a fresh build. A rank process runs `rank_main` alone.

mod common;
mod local_backend;

use std::io::Read;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use zrt_collectives::{init_from_env, CommError, DistEnv, ProcessGroup, ReduceOp};

const SCENARIO: &str = "ZRT_TEST_SCENARIO";
const BACKENDS: [&str; 2] = ["shm", "tcp"];

/// What one rank process printed and how it ended.
struct Ended {
    code: Option<i32>,
    out: String,
}

fn free_port() -> u16 {
    zrt_collectives::store::free_store_port("127.0.0.1").unwrap()
}

/// One job's rank processes, and the name its shared-memory files carry.
struct Ranks {
    children: Vec<Child>,
    job: String,
}

fn spawn(world: usize, scenario: &str, extra: &[(&str, &str)]) -> Ranks {
    let port = free_port();
    let token = format!("test-{}-{port}", std::process::id());
    let job = DistEnv {
        rank: 0,
        world_size: world,
        local_rank: 0,
        local_world_size: world,
        master_addr: "127.0.0.1".into(),
        master_port: port,
        token: token.clone(),
    }
    .job_id();
    let port = port.to_string();
    let children = (0..world)
        .map(|r| {
            let mut c = Command::new(std::env::current_exe().unwrap());
            c.args(["--exact", "rank_main", "--nocapture", "--test-threads=1"])
                .env(SCENARIO, scenario)
                .env("RANK", r.to_string())
                .env("WORLD_SIZE", world.to_string())
                .env("LOCAL_RANK", r.to_string())
                .env("LOCAL_WORLD_SIZE", world.to_string())
                .env("MASTER_ADDR", "127.0.0.1")
                .env("MASTER_PORT", &port)
                .env("ZRT_TOKEN", &token)
                // Only liveness checks, not this timeout, may end a wait quickly.
                .env("ZRT_TIMEOUT", "120")
                .stdout(Stdio::piped())
                .stderr(Stdio::piped());
            for (k, v) in extra {
                c.env(k, v);
            }
            c.spawn().unwrap()
        })
        .collect();
    Ranks { children, job }
}

/// Waits for every rank (killing those still running at `limit`), then
/// checks that the job left nothing in /dev/shm, however it ended: a
/// segment or buffer file that outlives its job holds memory until reboot.
fn finish(ranks: Ranks, limit: Duration) -> Vec<Ended> {
    let deadline = Instant::now() + limit;
    let ended: Vec<Ended> = ranks
        .children
        .into_iter()
        .map(|mut c| {
            let status = loop {
                if let Some(s) = c.try_wait().unwrap() {
                    break Some(s);
                }
                if Instant::now() >= deadline {
                    let _ = c.kill();
                    let _ = c.wait();
                    break None;
                }
                std::thread::sleep(Duration::from_millis(20));
            };
            let mut out = String::new();
            c.stdout.take().unwrap().read_to_string(&mut out).unwrap();
            let mut err = String::new();
            c.stderr.take().unwrap().read_to_string(&mut err).unwrap();
            out.push_str(&err);
            Ended {
                code: status.and_then(|s| s.code()),
                out,
            }
        })
        .collect();
    let prefix = format!("zrt-{}", ranks.job);
    let left: Vec<String> = std::fs::read_dir("/dev/shm")
        .unwrap()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with(&prefix))
        .collect();
    // The ranks' output goes with it: a rank that failed for another
    // reason is the likelier cause, and its message must not be lost.
    let printed: Vec<&str> = ended.iter().map(|e| e.out.as_str()).collect();
    assert!(
        left.is_empty(),
        "the job left files in /dev/shm: {left:?}; its ranks printed:\n{}",
        printed.join("\n---\n")
    );
    ended
}

fn run(world: usize, scenario: &str, extra: &[(&str, &str)], limit: Duration) -> Vec<Ended> {
    finish(spawn(world, scenario, extra), limit)
}

/// The line a rank printed as `@@ <text>`.
fn said(e: &Ended) -> &str {
    // libtest may print "test rank_main ... " on the same line first.
    e.out
        .lines()
        .find_map(|l| l.split_once("@@ ").map(|(_, s)| s))
        .unwrap_or_else(|| panic!("rank printed no result:\n{}", e.out))
}

/// Runs as a rank when re-executed by the tests above; a no-op otherwise.
#[test]
fn rank_main() {
    let Ok(scenario) = std::env::var(SCENARIO) else {
        return;
    };
    if scenario.starts_with("stalled") && std::env::var("RANK").as_deref() == Ok("0") {
        // Rank 0 gives up on a late rank 1 after half a second.
        std::env::set_var("ZRT_TIMEOUT", "0.5");
    }
    if scenario == "ops_rank1_small_slots" && std::env::var("RANK").as_deref() == Ok("1") {
        // Only rank 1 asks for other staging slots: the segment's layout
        // must still be rank 0's.
        std::env::set_var("ZRT_SHM_SLOT_BYTES", "4096");
    }
    if scenario == "staged_rank1_small_windows" && std::env::var("RANK").as_deref() == Ok("1") {
        // Only rank 1 asks for other TCP windows: the bytes on the wire
        // are the same either way.
        std::env::set_var("ZRT_TCP_WINDOW_BYTES", "4096");
    }
    let dist = match init_from_env() {
        Ok(d) => d,
        Err(e) => {
            println!("@@ err {e}");
            std::process::exit(1);
        }
    };
    let g = dist.world();
    let me = g.rank();
    let report = |r: Result<(), CommError>| match r {
        Ok(()) => println!("@@ ok"),
        Err(e) => println!("@@ err {e}"),
    };
    match scenario.as_str() {
        "ops" | "ops_rank1_small_slots" => {
            common::check_all_dtypes(g);
            if g.size() > 1 {
                // A rank cannot send to itself.
                common::check_send_recv(g);
            }
            common::check_late_rank(g);
            println!("@@ ok");
        }
        "mesh" => {
            let mut dist = dist;
            let mesh = dist.mesh(2).unwrap();
            let s = mesh
                .shard_group()
                .all_reduce(vec![me as i64], ReduceOp::Sum)
                .wait()
                .unwrap()[0];
            let p = mesh
                .replicate_group()
                .all_reduce(vec![me as i64], ReduceOp::Sum)
                .wait()
                .unwrap()[0];
            let (sr, pr) = (
                mesh.shard_group().world_ranks(),
                mesh.replicate_group().world_ranks(),
            );
            // Two groups of the same ranks are two groups: their own names,
            // sequences and buffers, with calls in flight on both at once.
            let (a, b) = (
                dist.new_group(&[0, 1, 2, 3]).unwrap(),
                dist.new_group(&[0, 1, 2, 3]).unwrap(),
            );
            let wa = a.all_reduce(vec![me as i64; 3], ReduceOp::Sum);
            let wb = b.all_reduce(vec![10 * me as i64; 5], ReduceOp::Sum);
            let (va, vb) = (wa.wait().unwrap(), wb.wait().unwrap());
            println!(
                "@@ {s} {p} {sr:?} {pr:?} {} {} {va:?} {vb:?}",
                a.name(),
                b.name()
            );
        }
        "late_send" => {
            // The sender comes a second late, several of the receiver's
            // polls of the store: the receive waits for it (up to
            // ZRT_TIMEOUT), it does not give up after one poll.
            // Also what the group says of itself: its name and counters.
            let stat = |op: &str| {
                g.stats()
                    .get(op)
                    .map(|s| (s.calls, s.bytes_sent, s.bytes_received))
            };
            if me == 1 {
                std::thread::sleep(Duration::from_secs(1));
                g.send(vec![7i64, 8, 9], 0).wait().unwrap();
                println!("@@ sent {} {:?}", g.name(), stat("send"));
            } else {
                let v = g.recv::<i64>(3, 1).wait().unwrap();
                println!("@@ {v:?} {} {:?}", g.name(), stat("recv"));
            }
        }
        "rank0_leaves_first" => {
            // Rank 0 is done at once; the others still talk through the
            // store it serves, which must stay up until they check out.
            if me == 0 {
                drop(dist);
                println!("@@ left");
            } else {
                std::thread::sleep(Duration::from_millis(500));
                let peer = 3 - me;
                let sent = g.send(vec![me as u8], peer);
                let got = g.recv::<u8>(1, peer).wait();
                report(sent.wait().and(got).map(|v| assert_eq!(v, [peer as u8])));
            }
        }
        "rank0_returns" => {
            // Rank 0 returns early (an error, or it ran out of data): its
            // `Dist` is dropped while the others wait for it in a collective.
            g.barrier().wait().unwrap();
            if me == 0 {
                drop(dist);
                println!("@@ returned");
            } else {
                report(
                    g.all_reduce(vec![1f32; 8], ReduceOp::Sum)
                        .wait()
                        .map(|_| ()),
                );
            }
        }
        "exit" => {
            g.all_reduce(vec![1f32; 8], ReduceOp::Sum).wait().unwrap();
            if me == 2 {
                std::process::exit(3);
            }
            report(
                g.all_reduce(vec![1f32; 8], ReduceOp::Sum)
                    .wait()
                    .map(|_| ()),
            );
        }
        "exit_before_group" => {
            g.barrier().wait().unwrap();
            if me == 2 {
                std::process::exit(3);
            }
            let mut dist = dist;
            report(dist.new_group(&[0, 1, 2]).map(|_| ()));
        }
        "exit_before_group_low" => {
            // The gone rank is the group's first: the creator of an shm
            // group, the one a tcp rank waits to be connected by.
            g.barrier().wait().unwrap();
            match me {
                1 => std::process::exit(3),
                2 => {
                    let mut dist = dist;
                    report(dist.new_group(&[1, 2]).map(|_| ()));
                }
                _ => println!("@@ ok"),
            }
        }
        "killed" => {
            g.barrier().wait().unwrap();
            if me == 1 {
                // The parent kills this process while rank 0 waits in the gather.
                println!("@@ waiting to be killed");
                std::thread::sleep(Duration::from_secs(60));
            }
            report(
                g.all_gather(vec![0u8; 1 << 20], Vec::new())
                    .wait()
                    .map(|_| ()),
            );
        }
        "mismatch" => {
            // One agreed call first, so the mismatch is at call #1.
            let r = g.barrier().wait().and_then(|()| {
                if me == 0 {
                    g.all_reduce(vec![0f32; 10], ReduceOp::Sum)
                        .wait()
                        .map(|_| ())
                } else {
                    g.all_gather(vec![0f32; 10], Vec::new()).wait().map(|_| ())
                }
            });
            report(r);
        }
        "size" => report(
            g.all_reduce(vec![0f32; 10 + 2 * me], ReduceOp::Sum)
                .wait()
                .map(|_| ()),
        ),
        "gather_size" => {
            // One rank's 6-element exchange met by the others' 1-element flag.
            let len = if me == 1 { 6 } else { 1 };
            report(g.all_gather(vec![0i64; len], Vec::new()).wait().map(|_| ()));
        }
        "recv_silent" | "recv_dead" => {
            // Rank 0 never sends: it waits (silent) or exits (dead).
            let dead = scenario == "recv_dead";
            if dead {
                // Rank 0 exits only once rank 1 has joined: else rank 1's
                // init would fail on the store rank 0 serves, not its recv.
                g.barrier().wait().unwrap();
            }
            if me == 0 {
                if dead {
                    std::process::exit(4);
                }
                std::thread::sleep(Duration::from_secs(3));
                println!("@@ ok");
            } else {
                let t = Instant::now();
                let r = g.recv::<f32>(4, 0).wait().map(|_| ());
                match r {
                    Ok(()) => println!("@@ ok"),
                    Err(e) => println!("@@ err {e} | {} s", t.elapsed().as_secs()),
                }
            }
        }
        "recv_size" => {
            // Rank 0 sends 5 elements; rank 1 expects 4.
            if me == 0 {
                report(g.send(vec![1f32; 5], 1).wait());
            } else {
                report(g.recv::<f32>(4, 0).wait().map(|_| ()));
            }
        }
        "symmetric_misuse" => {
            // Rank 0 passes a buffer of the world to another group, whose
            // rank 1 passes that group's own; then ranks pass buffers of
            // different allocations. Nobody may wait for anybody.
            let mut dist = dist;
            let pair = dist.new_group(&[0, 1]).unwrap();
            let g = dist.world();
            // A backend without shared memory takes a shm buffer through a copy.
            let mut c = g.alloc_symmetric::<f32>(3).wait().unwrap();
            c.copy_from_slice(&[1.0, 2.0, 3.0]);
            let solo = zrt_collectives::local::world(1);
            let c = solo[0].world().reduce_scatter_symmetric(c, ReduceOp::Sum);
            let c = c.wait().unwrap();
            assert!(c.is_shared() && c[..] == [1.0, 2.0, 3.0], "{c:?}");
            let a = g.alloc_symmetric::<f32>(10).wait().unwrap();
            let b = g.alloc_symmetric::<f32>(10).wait().unwrap();
            let p = pair.alloc_symmetric::<f32>(10).wait().unwrap();
            let foreign = if me == 0 {
                pair.reduce_scatter_symmetric(a, ReduceOp::Sum).wait()
            } else {
                pair.reduce_scatter_symmetric(p, ReduceOp::Sum).wait()
            };
            let a = g.alloc_symmetric::<f32>(10).wait().unwrap();
            let r = if me == 0 {
                g.reduce_scatter_symmetric(a, ReduceOp::Sum).wait()
            } else {
                g.reduce_scatter_symmetric(b, ReduceOp::Sum).wait()
            };
            match (foreign, r) {
                (Err(f), Err(m)) => println!("@@ {f} | {m}"),
                other => println!("@@ unexpected {other:?}"),
            }
        }
        "large" => {
            // Large enough for the streaming-store paths where the
            // last-level cache is 32 MiB or less, as on this project's
            // machines (an all_gather output of 64 MiB; a reduce_scatter
            // whose inputs and parts take 192 MiB); on a host with more the
            // plain paths are checked. Odd length: a tail past the last
            // whole line. The in-place and symmetric reduce_scatter too:
            // many windows of the f32 sum over this rank's own part.
            let len = 2 * (8 << 20) + 3;
            let input: Vec<f32> = (0..len).map(|i| common::val(me, i) as f32).collect();
            let mut sym = g.alloc_symmetric::<f32>(len).wait().unwrap();
            sym.copy_from_slice(&input);
            let sym = g
                .reduce_scatter_symmetric(sym, ReduceOp::Sum)
                .wait()
                .unwrap();
            let in_place = g
                .reduce_scatter_in_place(input.clone(), ReduceOp::Sum)
                .wait()
                .unwrap();
            let (_, part) = g
                .reduce_scatter(input, Vec::new(), ReduceOp::Sum)
                .wait()
                .unwrap();
            let r = zrt_collectives::chunk_range(len, 2, me);
            let sum = |i: usize| (common::val(0, i) + common::val(1, i)) as f32;
            let wrong = r.clone().zip(&part).position(|(i, &x)| x != sum(i));
            let wrong_own = |buf: &[f32]| r.clone().position(|i| buf[i] != sum(i));
            let (wrong_sym, wrong_in_place) = (wrong_own(&sym), wrong_own(&in_place));
            // Parts of 8 Mi + 2 and 8 Mi + 1: all_gather_v.
            let (_, all) = g.all_gather_v(part, Vec::new()).wait().unwrap();
            let wrong_all = (0..len).zip(&all).position(|(i, &x)| x != sum(i));
            // A type with no fused streaming kernel (only f32 has one; the
            // integers use the trait's default): each window is reduced into
            // a buffer, then streamed out. Inputs and parts take 96 MiB.
            let len = (4 << 20) + 3;
            let input: Vec<i64> = (0..len).map(|i| common::val(me, i)).collect();
            let (_, part) = g
                .reduce_scatter(input, Vec::new(), ReduceOp::Sum)
                .wait()
                .unwrap();
            let wrong_i64 = zrt_collectives::chunk_range(len, 2, me)
                .zip(&part)
                .position(|(i, &x)| x != common::val(0, i) + common::val(1, i));
            // An all_gather whose 16 MiB output stays below a 32 MiB cache
            // but whose parts and outputs do not: this rank's part is
            // streamed into the output, the peer's copied with plain
            // stores. Odd parts: a tail past the last whole vector.
            let l = (1 << 21) + 1;
            let part: Vec<f32> = (0..l).map(|i| common::val(me, i) as f32).collect();
            let (_, out) = g.all_gather(part, Vec::new()).wait().unwrap();
            let wrong_gather = (0..2 * l).position(|i| out[i] != common::val(i / l, i % l) as f32);
            println!(
                "@@ {} {wrong:?} {wrong_all:?} {wrong_sym:?} {wrong_in_place:?} {wrong_i64:?} \
                 {wrong_gather:?} {}",
                all.len(),
                out.len()
            );
        }
        "staged" | "staged_rank1_small_windows" => {
            // Several rounds of windows of at least 4 KiB on any world size
            // (with the default 512 KiB slots), so streaming slot stores are
            // used where the policy asks for them: every staged operation
            // against sums and parts worked out here.
            let n = g.size();
            let column = |i: usize| (0..n).map(|r| common::val(r, i)).sum::<i64>() as f32;
            let len = 100_003;
            let input: Vec<f32> = (0..len).map(|i| common::val(me, i) as f32).collect();
            let all = g.all_reduce(input.clone(), ReduceOp::Sum).wait().unwrap();
            let mut wrong = Vec::new();
            if (0..len).any(|i| all[i] != column(i)) {
                wrong.push("all_reduce");
            }
            let mine = zrt_collectives::chunk_range(len, n, me);
            let (_, part) = g
                .reduce_scatter(input.clone(), Vec::new(), ReduceOp::Sum)
                .wait()
                .unwrap();
            if mine.clone().zip(&part).any(|(i, &x)| x != column(i)) {
                wrong.push("reduce_scatter");
            }
            let in_place = g
                .reduce_scatter_in_place(input, ReduceOp::Sum)
                .wait()
                .unwrap();
            if mine.clone().any(|i| in_place[i] != column(i)) {
                wrong.push("reduce_scatter_in_place");
            }
            // Reductions with no kernel over their own source (`reduce_over`
            // has f32 sums only): reduced into scratch and copied back.
            let ints: Vec<i64> = (0..len).map(|i| common::val(me, i)).collect();
            let all = g.all_reduce(ints.clone(), ReduceOp::Sum).wait().unwrap();
            let int_column = |i: usize| (0..n).map(|r| common::val(r, i)).sum::<i64>();
            if (0..len).any(|i| all[i] != int_column(i)) {
                wrong.push("all_reduce i64");
            }
            let top = g
                .reduce_scatter_in_place(ints.iter().map(|&x| x as f32).collect(), ReduceOp::Max)
                .wait()
                .unwrap();
            let max = |i: usize| (0..n).map(|r| common::val(r, i)).max().unwrap_or(0) as f32;
            if mine.clone().any(|i| top[i] != max(i)) {
                wrong.push("reduce_scatter_in_place max");
            }
            // Values whose sums round: an all_reduce, small (tcp's is
            // then one exchange of whole buffers) or not, holds the bits of
            // the reduce_scatter's parts. f64 sums depend on the order of
            // the ranks (reversed, world 3 fails here); f32 ones are summed
            // in f64, but their averages must still be taken alike.
            for len in [3001, 100_003] {
                if !reduces_alike(g, len, |x| x as f32) || !reduces_alike(g, len, |x| x) {
                    wrong.push("all_reduce against reduce_scatter, to the bit");
                }
            }
            let part_len = 150_001;
            let own: Vec<f32> = (0..part_len).map(|i| common::val(me, i) as f32).collect();
            let (_, gathered) = g.all_gather(own, Vec::new()).wait().unwrap();
            let expect = |k: usize| common::val(k / part_len, k % part_len) as f32;
            if gathered.len() != n * part_len || (0..n * part_len).any(|k| gathered[k] != expect(k))
            {
                wrong.push("all_gather");
            }
            // all_to_all of 2 MiB + 4 B per rank (streamed destinations on
            // shm; many windows either way): rank q's chunk `me` from each q.
            let whole = n * (1 << 19) + 1;
            let input: Vec<f32> = (0..whole).map(|i| common::val(me, i) as f32).collect();
            let (_, got) = g.all_to_all(input, Vec::new()).wait().unwrap();
            let expect: Vec<f32> = (0..n)
                .flat_map(|q| {
                    zrt_collectives::chunk_range(whole, n, me)
                        .map(move |i| common::val(q, i) as f32)
                })
                .collect();
            if got != expect {
                wrong.push("all_to_all");
            }
            let from_last = (0..len)
                .map(|i| common::val(n - 1, i) as f32)
                .collect::<Vec<f32>>();
            let buf = match me == n - 1 {
                true => from_last.clone(),
                false => vec![0f32; len],
            };
            if g.broadcast(buf, n - 1).wait().unwrap() != from_last {
                wrong.push("broadcast");
            }
            println!("@@ wrong: {wrong:?}");
        }
        "symmetric_too_big" => {
            // More than /dev/shm holds: tmpfs refuses the reservation at once.
            let r = g.alloc_symmetric::<u8>(1 << 42).wait().map(|_| ());
            let after = g.all_reduce(vec![1f32], ReduceOp::Sum).wait().unwrap();
            println!(
                "@@ {} | {}",
                r.err().map_or("ok".into(), |e| e.to_string()),
                after[0]
            );
        }
        "symmetric_rank1_fails" => {
            // Only rank 1 cannot create its buffer: its files may not grow
            // past 64 KiB (a soft limit, raised back after), so reserving
            // 1 MiB fails with EFBIG (SIGXFSZ ignored, or it would kill it).
            // SAFETY (the calls below): getrlimit and setrlimit read and
            // write the plain struct they are given; ignoring SIGXFSZ
            // installs no handler.
            let fsize = |cur: u64| {
                let mut l: libc::rlimit = unsafe { std::mem::zeroed() };
                assert_eq!(unsafe { libc::getrlimit(libc::RLIMIT_FSIZE, &mut l) }, 0);
                let old = l.rlim_cur;
                l.rlim_cur = cur;
                assert_eq!(unsafe { libc::setrlimit(libc::RLIMIT_FSIZE, &l) }, 0);
                old
            };
            let old = (me == 1).then(|| unsafe {
                libc::signal(libc::SIGXFSZ, libc::SIG_IGN);
                fsize(64 << 10)
            });
            let t = Instant::now();
            let r = g.alloc_symmetric::<u8>(1 << 20).wait().map(|_| ());
            let fast = t.elapsed() < Duration::from_secs(10);
            if let Some(old) = old {
                fsize(old);
            }
            let after = g.all_reduce(vec![1f32], ReduceOp::Sum).wait().unwrap();
            println!(
                "@@ {} | {fast} | {}",
                r.err().map_or("ok".into(), |e| e.to_string()),
                after[0]
            );
        }
        "stalled" | "stalled_barrier" => {
            // The late rank's call: a gather, or a barrier (which moves no
            // data), and what it returns.
            let gather = |v: u8| match scenario.as_str() {
                "stalled" => g.all_gather(vec![v; 1000], Vec::new()).wait(),
                _ => g.barrier().wait().map(|()| (Vec::new(), vec![v; 4])),
            };
            if me == 0 {
                // Timed out waiting for rank 1; then a call that must not run.
                let a = gather(7).err().map_or("ok".into(), |e| e.to_string());
                let t = Instant::now();
                let b = gather(7).err().map_or("ok".into(), |e| e.to_string());
                println!(
                    "@@ {a} | {b} | {}",
                    t.elapsed() < Duration::from_millis(250)
                );
                // Alive until rank 1 is done: it must learn from the group,
                // not from this process's exit.
                std::thread::sleep(Duration::from_secs(4));
            } else {
                std::thread::sleep(Duration::from_millis(1500));
                let t = Instant::now();
                match gather(9) {
                    // Never rank 0's slot as it was left: it wrote no part.
                    Ok((_, all)) => println!("@@ ok {:?}", &all[..4]),
                    Err(e) => println!("@@ {e} | {}", t.elapsed() < Duration::from_secs(1)),
                }
            }
        }
        "reverse_waits" => {
            // Rank 0 waits for its last call first, while rank 1 has not
            // issued any: the waiter may run a call itself only in its
            // turn. Run out of turn, rank 0's first call would meet rank
            // 1's first, of another size, and both would fail naming them.
            if me == 1 {
                std::thread::sleep(Duration::from_millis(200));
            }
            let mut works: Vec<_> = (1..=3)
                .map(|k| g.all_reduce(vec![k as f64; k], ReduceOp::Sum))
                .collect();
            if me == 0 {
                works.reverse();
            }
            let n = g.size() as f64;
            report(works.into_iter().try_for_each(|w| {
                let v = w.wait()?;
                assert_eq!(v, vec![n * v.len() as f64; v.len()]);
                Ok(())
            }));
        }
        other => panic!("unknown scenario {other}"),
    }
}

/// Whether `g`'s all_reduce (sum and average) of `len` values that round
/// holds at this rank's part what its reduce_scatter gives, to the bit.
fn reduces_alike<T>(g: &impl ProcessGroup, len: usize, make: fn(f64) -> T) -> bool
where
    T: zrt_collectives::Element + Into<f64>,
{
    let me = g.rank();
    let xs: Vec<T> = (0..len)
        .map(|i| make((i as f64 * 0.37 + me as f64 * 1.3).sin() * 10.0))
        .collect();
    let mine = zrt_collectives::chunk_range(len, g.size(), me);
    [ReduceOp::Sum, ReduceOp::Avg].into_iter().all(|op| {
        let all = g.all_reduce(xs.clone(), op).wait().unwrap();
        let (_, part) = g.reduce_scatter(xs.clone(), Vec::new(), op).wait().unwrap();
        let bits = |v: &[T]| v.iter().map(|&x| x.into().to_bits()).collect::<Vec<u64>>();
        bits(&all[mine.clone()]) == bits(&part)
    })
}

#[test]
fn every_op_dtype_and_uneven_size_across_processes() {
    // Small staging slots force many windows per op on shm.
    for backend in BACKENDS {
        for world in [1, 2, 3, 4] {
            // And small windows on tcp.
            let env = [
                ("ZRT_SHM_SLOT_BYTES", "4096"),
                ("ZRT_TCP_WINDOW_BYTES", "4096"),
                ("ZRT_BACKEND", backend),
            ];
            for e in run(world, "ops", &env, Duration::from_secs(120)) {
                assert_eq!(e.code, Some(0), "{backend} world {world}:\n{}", e.out);
                assert_eq!(said(&e), "ok");
            }
        }
    }
}

#[test]
fn waiting_for_a_later_call_first_still_runs_the_calls_in_issue_order() {
    for backend in BACKENDS {
        for e in run(
            2,
            "reverse_waits",
            &[("ZRT_BACKEND", backend)],
            Duration::from_secs(60),
        ) {
            assert_eq!(e.code, Some(0), "{backend}:\n{}", e.out);
            assert_eq!(said(&e), "ok", "{backend}");
        }
    }
}

/// Streamed destinations, and in-place and symmetric reduce_scatter over
/// many windows, give exact sums (the "large" scenario), whether the ranks
/// write their staging slots with plain or streaming stores (the default
/// measures and chooses, so either may run there).
#[test]
fn large_buffers_stream_and_reduce_in_place_exactly() {
    for stores in ["auto", "streaming", "plain"] {
        for e in run(
            2,
            "large",
            &[("ZRT_BACKEND", "shm"), ("ZRT_SHM_SLOT_STORES", stores)],
            Duration::from_secs(120),
        ) {
            assert_eq!(e.code, Some(0), "{stores}: {}", e.out);
            assert_eq!(
                said(&e),
                format!(
                    "{} None None None None None None {}",
                    2 * (8 << 20) + 3,
                    2 * ((1 << 21) + 1)
                ),
                "{stores}"
            );
        }
    }
}

/// Every staged operation on 2, 3 and 4 processes, over several rounds of
/// windows large enough to stream, under each slot-store policy.
#[test]
fn staged_operations_are_exact_under_every_slot_store_policy() {
    for stores in ["streaming", "plain", "auto"] {
        for world in [2, 3, 4] {
            let env = [("ZRT_BACKEND", "shm"), ("ZRT_SHM_SLOT_STORES", stores)];
            for e in run(world, "staged", &env, Duration::from_secs(120)) {
                assert_eq!(e.code, Some(0), "{stores}, world {world}:\n{}", e.out);
                assert_eq!(said(&e), "wrong: []", "{stores}, world {world}");
            }
        }
    }
}

/// The TCP backend's reductions over many windows (4 KiB each: dozens per
/// operation, the last one short) on 2, 3 and 4 processes give the exact
/// results the staged scenario expects, and so do ranks that use windows
/// of different sizes (a window is how much a rank takes before it
/// reduces; each connection carries the same bytes in the same order).
#[test]
fn tcp_reductions_over_many_windows_are_exact() {
    for world in [2, 3, 4] {
        let env = [("ZRT_BACKEND", "tcp"), ("ZRT_TCP_WINDOW_BYTES", "4096")];
        for e in run(world, "staged", &env, Duration::from_secs(120)) {
            assert_eq!(e.code, Some(0), "world {world}:\n{}", e.out);
            assert_eq!(said(&e), "wrong: []", "world {world}");
        }
    }
    for world in [2, 3] {
        let env = [("ZRT_BACKEND", "tcp"), ("ZRT_TIMEOUT", "20")];
        let scenario = "staged_rank1_small_windows";
        for e in run(world, scenario, &env, Duration::from_secs(60)) {
            assert_eq!(e.code, Some(0), "world {world}:\n{}", e.out);
            assert_eq!(said(&e), "wrong: []", "world {world}");
        }
    }
}

#[test]
fn mesh_groups_across_processes() {
    for backend in BACKENDS {
        let got: Vec<String> = run(
            4,
            "mesh",
            &[("ZRT_BACKEND", backend)],
            Duration::from_secs(60),
        )
        .iter()
        .map(|e| said(e).to_string())
        .collect();
        assert_eq!(
            got,
            [
                "1 2 [0, 1] [0, 2]",
                "1 4 [0, 1] [1, 3]",
                "5 2 [2, 3] [0, 2]",
                "5 4 [2, 3] [1, 3]"
            ]
            .map(|m| format!(
                "{m} ranks[0, 1, 2, 3]#0 ranks[0, 1, 2, 3]#1 [6, 6, 6] [60, 60, 60, 60, 60]"
            )),
            "{backend}"
        );
    }
}

#[test]
fn a_receive_waits_for_a_late_sender() {
    for backend in BACKENDS {
        let got: Vec<String> = run(
            2,
            "late_send",
            &[("ZRT_BACKEND", backend)],
            Duration::from_secs(60),
        )
        .iter()
        .map(|e| said(e).to_string())
        .collect();
        assert_eq!(
            got,
            [
                "[7, 8, 9] world Some((1, 0, 24))",
                "sent world Some((1, 24, 0))"
            ],
            "{backend}"
        );
    }
}

#[test]
fn rank_0_serves_the_store_until_every_rank_checked_out() {
    for backend in BACKENDS {
        let got: Vec<String> = run(
            3,
            "rank0_leaves_first",
            &[("ZRT_BACKEND", backend)],
            Duration::from_secs(60),
        )
        .iter()
        .map(|e| format!("{:?} {}", e.code, said(e)))
        .collect();
        assert_eq!(
            got,
            ["Some(0) left", "Some(0) ok", "Some(0) ok"],
            "{backend}"
        );
    }
}

/// Runs `scenario` on 3 ranks of `backend`, asserting that the whole run
/// (a fault included) ends well within the children's ZRT_TIMEOUT (120 s).
fn run_3_quickly(scenario: &str, backend: &str) -> Vec<Ended> {
    let t = Instant::now();
    let ended = run(
        3,
        scenario,
        &[("ZRT_BACKEND", backend)],
        Duration::from_secs(60),
    );
    assert!(
        t.elapsed() < Duration::from_secs(20),
        "{scenario} on {backend} took {:?}",
        t.elapsed()
    );
    ended
}

/// Runs `scenario` on 3 ranks of each backend: rank `gone` leaves (and
/// its process ends with `code`) while the others wait for it in an
/// all_reduce, which must fail naming it, the whole run well within the
/// children's ZRT_TIMEOUT (120 s). Returns each backend's ranks.
fn check_peers_of_a_gone_rank_fail(scenario: &str, gone: usize, code: i32) -> Vec<Vec<Ended>> {
    let mut runs = Vec::new();
    for backend in BACKENDS {
        let ended = run_3_quickly(scenario, backend);
        assert_eq!(ended[gone].code, Some(code), "{backend}");
        for (r, e) in ended.iter().enumerate().filter(|&(r, _)| r != gone) {
            let s = said(e);
            assert!(
                s.starts_with(&format!("err rank {gone} of group `world` died or left the group during all_reduce(f32 x 8, Sum)")),
                "{backend} rank {r}: {s}"
            );
        }
        runs.push(ended);
    }
    runs
}

#[test]
fn rank_0_returning_early_fails_its_peers_within_seconds() {
    // Rank 0 serves the store, so dropping its `Dist` waits for the others
    // to check out; it must leave its groups first, or the others wait for
    // it in their collective, and it for them, until ZRT_TIMEOUT.
    for ended in check_peers_of_a_gone_rank_fail("rank0_returns", 0, 0) {
        assert_eq!(said(&ended[0]), "returned");
    }
}

#[test]
fn a_rank_that_exits_fails_its_peers_within_seconds() {
    check_peers_of_a_gone_rank_fail("exit", 2, 3);
}

#[test]
fn a_rank_that_exits_before_a_group_it_belongs_to_fails_the_join_naming_it() {
    // Ranks 0 and 1 create a group with rank 2, which has exited: they
    // stop waiting for its step of the join when its store connection
    // closes, not at the children's ZRT_TIMEOUT (120 s).
    for backend in BACKENDS {
        let ended = run_3_quickly("exit_before_group", backend);
        assert_eq!(ended[2].code, Some(3), "{backend}");
        for e in &ended[..2] {
            let s = said(e);
            assert!(
                s.starts_with("err rendezvous failed: rank 2 left the job before it could ")
                    && s.contains("its process exited, died or dropped its `Dist`"),
                "{backend}: {s}"
            );
        }
        let ended = run_3_quickly("exit_before_group_low", backend);
        assert_eq!(ended[1].code, Some(3), "{backend}");
        assert_eq!(said(&ended[0]), "ok", "{backend}");
        let s = said(&ended[2]);
        assert!(
            s.starts_with("err rendezvous failed: ")
                && s.contains("rank 1 left the job before it")
                && s.contains("its process exited, died or dropped its `Dist`"),
            "{backend}: {s}"
        );
    }
}

#[test]
fn a_rank_killed_mid_collective_fails_its_peer_within_5_seconds() {
    for backend in BACKENDS {
        let mut ranks = spawn(2, "killed", &[("ZRT_BACKEND", backend)]);
        // Wait until rank 1 says it is parked, then kill it without warning.
        let mut buf = [0u8; 1];
        let mut line = Vec::new();
        let out1 = ranks.children[1].stdout.as_mut().unwrap();
        while !String::from_utf8_lossy(&line).contains("@@ waiting") {
            if out1.read(&mut buf).unwrap() == 0 {
                break;
            }
            line.push(buf[0]);
        }
        std::thread::sleep(Duration::from_millis(200));
        ranks.children[1].kill().unwrap();
        let t = Instant::now();
        let ended = finish(ranks, Duration::from_secs(60));
        assert!(
            t.elapsed() < Duration::from_secs(5),
            "{backend}: detection took {:?}",
            t.elapsed()
        );
        let s = said(&ended[0]);
        assert!(
            s.starts_with("err rank 1 of group `world` died or left the group during all_gather(u8 x 1048576)"),
            "{backend}: {s}"
        );
    }
}

#[test]
fn a_rank_that_timed_out_leaves_the_group_and_the_late_rank_learns_it() {
    // A gather, and a barrier: it moves no data, but a late rank must not
    // pass one that its peer reached and then gave up on either.
    for (scenario, call) in [
        ("stalled", "all_gather(u8 x 1000)"),
        ("stalled_barrier", "barrier()"),
    ] {
        for backend in BACKENDS {
            let ended = run(
                2,
                scenario,
                &[("ZRT_BACKEND", backend)],
                Duration::from_secs(60),
            );
            let (zero, one) = (said(&ended[0]), said(&ended[1]));
            assert!(
                zero.starts_with(&format!(
                    "{call} on group `world` timed out after 0.5 s waiting for rank(s) [1]"
                )) && zero.contains(&format!(
                    "| {call} on group `world` was not run: an earlier collective on the group failed on this rank"
                )) && zero.ends_with("| true"),
                "{backend}: {zero}"
            );
            // Rank 1 arrives late, while rank 0 is still alive: it is told
            // at once that rank 0 left, instead of running the call against
            // a rank that is no longer in it.
            assert_eq!(
                one,
                format!("rank 0 of group `world` died or left the group during {call}: every rank must stay until the last collective (a rank that ran out of data and returned early leaves too: give every rank the same number of steps); otherwise check rank 0's output for its error | true"),
                "{backend}"
            );
        }
    }
}

#[test]
fn a_recv_whose_sender_never_sends_or_exits_fails_naming_it() {
    for backend in BACKENDS {
        let env = [("ZRT_BACKEND", backend), ("ZRT_TIMEOUT", "1")];
        let ended = run(2, "recv_silent", &env, Duration::from_secs(60));
        let s = said(&ended[1]);
        assert!(
            s.starts_with("err recv(f32 x 4")
                && s.contains("timed out after 1.0 s waiting for rank(s) [0]"),
            "{backend} silent: {s}"
        );
        let env = [("ZRT_BACKEND", backend), ("ZRT_TIMEOUT", "30")];
        let ended = run(2, "recv_dead", &env, Duration::from_secs(60));
        assert_eq!(ended[0].code, Some(4), "{backend}");
        let s = said(&ended[1]);
        assert!(
            s.starts_with("err rank 0 of group `world` died or left the group during recv(f32 x 4"),
            "{backend} dead: {s}"
        );
        // Well before the 30 s timeout.
        let secs: u64 = s
            .rsplit("| ")
            .next()
            .unwrap()
            .trim_end_matches(" s")
            .parse()
            .unwrap();
        assert!(secs <= 5, "{backend} dead after {secs} s: {s}");
    }
}

#[test]
fn different_collectives_or_sizes_name_both_calls() {
    for backend in BACKENDS {
        for e in run(
            2,
            "mismatch",
            &[("ZRT_BACKEND", backend)],
            Duration::from_secs(60),
        ) {
            let s = said(&e);
            assert!(
                s.contains("collective mismatch on group `world` at call #1"),
                "{backend}: {s}"
            );
            assert!(
                s.contains("all_reduce(f32 x 10, Sum)") && s.contains("all_gather(f32 x 10)"),
                "{backend}: {s}"
            );
        }
        // The same collective with other sizes, on 3 ranks: the calls each names.
        let sizes = [
            ("size", ["f32 x 10, Sum", "f32 x 12, Sum"]),
            (
                "gather_size",
                ["all_gather(i64 x 1)", "all_gather(i64 x 6)"],
            ),
        ];
        for (role, [a, b]) in sizes {
            for e in run(
                3,
                role,
                &[("ZRT_BACKEND", backend)],
                Duration::from_secs(60),
            ) {
                let s = said(&e);
                assert!(
                    s.contains("collective mismatch") && s.contains(a) && s.contains(b),
                    "{backend} {role}: {s}"
                );
            }
        }
        // A receive of another size than the send: the receiver is told
        // both, not handed a buffer of the wrong length.
        let ended = run(
            2,
            "recv_size",
            &[("ZRT_BACKEND", backend)],
            Duration::from_secs(60),
        );
        let s = said(&ended[1]);
        assert!(
            s.contains("collective mismatch") && s.contains("f32 x 5") && s.contains("f32 x 4"),
            "{backend} recv_size: {s}"
        );
    }
}

#[test]
fn symmetric_buffers_of_another_group_or_allocation_are_refused() {
    let t = Instant::now();
    let ended = run(
        2,
        "symmetric_misuse",
        &[("ZRT_BACKEND", "shm")],
        Duration::from_secs(60),
    );
    // Well under ZRT_TIMEOUT (120 s): a rank left waiting would show here.
    assert!(t.elapsed() < Duration::from_secs(20), "{:?}", t.elapsed());
    let said: Vec<(&str, &str)> = ended
        .iter()
        .map(|e| {
            said(e)
                .split_once(" | ")
                .unwrap_or_else(|| panic!("{}", e.out))
        })
        .collect();
    assert_eq!(said[0].0, "invalid reduce_scatter(f32 x 10, Sum) on group `ranks[0, 1]#0`: the symmetric buffer was allocated by another group: use a buffer from this group's alloc_symmetric");
    assert!(
        said[1].0.starts_with("collective mismatch on group `ranks[0, 1]#0` at call #1: rank 0 called reduce_scatter(f32 x 10, Sum) but rank 1 called reduce_scatter(f32 x 10, Sum) on symmetric buffer #0;"),
        "{}",
        said[1].0
    );
    for (_, mismatch) in said {
        assert!(
            mismatch.contains("collective mismatch on group `world`")
                && mismatch
                    .contains("rank 0 called reduce_scatter(f32 x 10, Sum) on symmetric buffer #3")
                && mismatch
                    .contains("rank 1 called reduce_scatter(f32 x 10, Sum) on symmetric buffer #2"),
            "{mismatch}"
        );
    }
}

#[test]
fn a_symmetric_buffer_shm_cannot_hold_fails_every_rank_and_the_group_goes_on() {
    for e in run(
        2,
        "symmetric_too_big",
        &[("ZRT_BACKEND", "shm")],
        Duration::from_secs(60),
    ) {
        let s = said(&e);
        assert!(
            s.starts_with("alloc_symmetric(u8 x 4398046511104) on symmetric buffer #0 on group `world` could not set up shared memory: reserving 4398046511104 bytes for /dev/shm/zrt-")
                && s.ends_with("No space left on device (os error 28); free space in /dev/shm (see `df /dev/shm`) or allocate smaller buffers | 2"),
            "{s}"
        );
    }
}

#[test]
fn a_symmetric_buffer_one_rank_cannot_create_fails_every_rank_naming_it() {
    let ends = run(
        2,
        "symmetric_rank1_fails",
        &[("ZRT_BACKEND", "shm")],
        Duration::from_secs(60),
    );
    let call = "alloc_symmetric(u8 x 1048576) on symmetric buffer #0 on group `world` could not set up shared memory: ";
    let tail =
        "; free space in /dev/shm (see `df /dev/shm`) or allocate smaller buffers | true | 2";
    let s = said(&ends[0]);
    assert_eq!(
        s,
        format!("{call}rank 1 failed to create its buffer (its own error says why){tail}")
    );
    let s = said(&ends[1]);
    assert!(
        s.starts_with(&format!("{call}reserving 1048576 bytes for /dev/shm/zrt-"))
            && s.ends_with(&format!("File too large (os error 27){tail}")),
        "{s}"
    );
}

#[test]
fn an_unknown_backend_is_refused_naming_the_choices() {
    for e in run(2, "ops", &[("ZRT_BACKEND", "mpi")], Duration::from_secs(30)) {
        assert_eq!(e.code, Some(1));
        assert_eq!(said(&e), "err rendezvous failed: ZRT_BACKEND=\"mpi\" is not a backend: use shm (one host) or tcp (any hosts)");
    }
}

#[test]
fn a_malformed_timeout_slot_size_slot_store_or_tcp_window_is_refused_naming_it() {
    for (key, value, want) in [
        (
            "ZRT_TIMEOUT",
            "30s",
            "is not a positive number of seconds (e.g. ZRT_TIMEOUT=600)",
        ),
        (
            "ZRT_SHM_SLOT_BYTES",
            "512k",
            "is not a byte count from 4096",
        ),
        (
            "ZRT_TCP_WINDOW_BYTES",
            "4M",
            "is not a byte count from 4096 to 1073741824 (e.g. ZRT_TCP_WINDOW_BYTES=4194304, the default)",
        ),
        (
            "ZRT_SHM_SLOT_STORES",
            "nt",
            "is not one of auto (the default: measure and choose), plain or streaming",
        ),
    ] {
        for e in run(2, "ops", &[(key, value)], Duration::from_secs(30)) {
            assert_eq!(e.code, Some(1), "{}", e.out);
            let s = said(&e);
            assert!(
                s.starts_with(&format!("err rendezvous failed: {key}=\"{value}\" {want}")),
                "{s}"
            );
        }
    }
}

#[test]
fn ranks_started_with_other_slot_sizes_use_rank_0s_layout() {
    let env = [("ZRT_BACKEND", "shm")];
    for e in run(2, "ops_rank1_small_slots", &env, Duration::from_secs(120)) {
        assert_eq!(e.code, Some(0), "{}", e.out);
        assert_eq!(said(&e), "ok");
    }
}

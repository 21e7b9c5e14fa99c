//! The local (threads) backend with real ranks: every op x dtype x world size
//! x sizes that do not divide evenly, against a naive reference; and every
//! fault, each finishing in bounded time with an error that names it.

use std::time::{Duration, Instant};

use zrt_collectives::local::{self, LocalRank};
use zrt_collectives::{CommError, ProcessGroup, ReduceOp};

/// Runs `f` on every rank of a fresh world, one thread each; results in rank order.
fn run<R: Send>(size: usize, timeout: Duration, f: impl Fn(LocalRank) -> R + Sync) -> Vec<R> {
    let ranks = local::world_with_timeout(size, timeout);
    std::thread::scope(|s| {
        let hs: Vec<_> = ranks.into_iter().map(|r| s.spawn(|| f(r))).collect();
        hs.into_iter()
            .map(|h| h.join().expect("rank thread panicked"))
            .collect()
    })
}

use crate::common;

#[test]
fn every_op_dtype_and_uneven_size_on_worlds_of_1_2_3_4() {
    for world in [1, 2, 3, 4] {
        run(world, Duration::from_secs(60), |r| {
            common::check_all_dtypes(r.world())
        });
    }
}

#[test]
fn a_late_rank_holds_the_barrier_and_still_broadcasts() {
    run(3, Duration::from_secs(30), |r| {
        common::check_late_rank(r.world())
    });
}

#[test]
fn send_recv_ring() {
    run(3, Duration::from_secs(30), |r| {
        common::check_send_recv(r.world())
    });
}

#[test]
fn send_recv_in_a_ring_and_stats_count_bytes() {
    let got = run(3, Duration::from_secs(30), |r| {
        let g = r.world();
        let (me, n) = (g.rank(), g.size());
        let sent = g.send(vec![me as f32; 5], (me + 1) % n);
        let v = g.recv::<f32>(5, (me + n - 1) % n).wait().unwrap();
        sent.wait().unwrap();
        let ar = g
            .all_reduce(vec![1.0f32; 100], ReduceOp::Sum)
            .wait()
            .unwrap();
        assert_eq!(ar, vec![3.0; 100]);
        let s = g.stats().get("all_reduce").unwrap();
        assert_eq!((s.calls, s.bytes_sent, s.bytes_received), (1, 400, 400));
        assert_eq!(g.stats().get("send").unwrap().bytes_sent, 20);
        v
    });
    assert_eq!(got, vec![vec![2.0; 5], vec![0.0; 5], vec![1.0; 5]]);
}

#[test]
fn stats_count_each_message_size_and_tell_an_observer_of_each_op() {
    use std::sync::{Arc, Mutex};
    use zrt_collectives::{OpRecord, SizeStats};
    let got = run(3, Duration::from_secs(30), |r| {
        let g = r.world();
        let told: Arc<Mutex<Vec<(&'static str, u64)>>> = Arc::default();
        let t = told.clone();
        g.stats().observe(Some(Arc::new(move |o: &OpRecord| {
            t.lock().unwrap().push((o.op, o.bytes))
        })));
        for len in [10, 6, 10] {
            g.all_reduce(vec![1f32; len], ReduceOp::Sum).wait().unwrap();
        }
        // The message is the whole buffer: a reduce-scatter's input (12
        // f32, each rank keeping 4), a gather's output (3 ranks x 2 f64).
        let rs = g.reduce_scatter(vec![1f32; 12], vec![0f32; 4], ReduceOp::Sum);
        rs.wait().unwrap();
        g.all_gather(vec![1f64; 2], vec![0f64; 6]).wait().unwrap();
        g.stats().observe(None);
        g.broadcast(vec![0u8; 3], 0).wait().unwrap();
        let told = told.lock().unwrap().clone();
        let rows: Vec<(&str, u64, u64)> = g
            .stats()
            .by_size()
            .iter()
            .map(|s: &SizeStats| (s.op, s.bytes, s.calls))
            .collect();
        let timed = g.stats().by_size().iter().all(|s| s.time > Duration::ZERO);
        (told, rows, timed)
    });
    for (told, rows, timed) in got {
        // The broadcast came after the observer was removed.
        assert_eq!(
            told,
            [
                ("all_reduce", 40),
                ("all_reduce", 24),
                ("all_reduce", 40),
                ("reduce_scatter", 48),
                ("all_gather", 48)
            ]
        );
        assert_eq!(
            rows,
            [
                ("all_reduce", 24, 1),
                ("all_reduce", 40, 2),
                ("reduce_scatter", 48, 1),
                ("all_gather", 48, 1),
                ("broadcast", 3, 1)
            ]
        );
        assert!(timed);
    }
}

#[test]
fn a_recv_of_another_length_or_dtype_than_the_send_is_an_error() {
    for (len, f64_recv) in [(4usize, false), (5, true)] {
        let got = run(2, Duration::from_secs(30), |r| {
            let g = r.world();
            if g.rank() == 0 {
                g.send(vec![1f32; 5], 1).wait().unwrap();
                None
            } else if f64_recv {
                Some(g.recv::<f64>(len, 0).wait().unwrap_err().to_string())
            } else {
                Some(g.recv::<f32>(len, 0).wait().unwrap_err().to_string())
            }
        });
        let e = got[1].clone().unwrap();
        let want = if f64_recv { "f64 x 5" } else { "f32 x 4" };
        assert!(
            e.contains("collective mismatch") && e.contains("f32 x 5") && e.contains(want),
            "{e}"
        );
    }
}

#[test]
fn issued_calls_run_in_order_while_the_caller_goes_on() {
    run(2, Duration::from_secs(30), |r| {
        let g = r.world();
        // Issue three before waiting on any: results must match issue order.
        let works: Vec<_> = (0..3)
            .map(|k| g.all_reduce(vec![k as f64; 4], ReduceOp::Sum))
            .collect();
        for (k, w) in works.into_iter().enumerate() {
            assert_eq!(w.wait().unwrap(), vec![2.0 * k as f64; 4]);
        }
    });
}

#[test]
fn a_handle_is_done_only_once_every_rank_has_issued_its_call() {
    let both_issued = std::sync::Barrier::new(2);
    run(2, Duration::from_secs(30), |r| {
        let g = r.world();
        if g.rank() == 1 {
            // Rank 0 looks at its handle before this rank has issued.
            both_issued.wait();
            let w = g.all_reduce(vec![1i64; 3], ReduceOp::Sum);
            assert_eq!(w.wait().unwrap(), vec![2; 3]);
            return;
        }
        let w = g.all_reduce(vec![1i64; 3], ReduceOp::Sum);
        std::thread::sleep(Duration::from_millis(50));
        let (early, shown) = (w.is_done(), format!("{w:?}"));
        // Asserted after the barrier: a failure before it would leave the
        // peer waiting there for good.
        both_issued.wait();
        assert!(!early, "done before the peer issued its call");
        assert!(shown.contains("done: false"), "{shown}");
        // Not waited for: the group's worker completes it on its own.
        let t = Instant::now();
        while !w.is_done() {
            assert!(t.elapsed() < Duration::from_secs(10), "never done");
            std::thread::sleep(Duration::from_millis(1));
        }
        assert!(format!("{w:?}").contains("done: true"), "{w:?}");
        let t = Instant::now();
        assert_eq!(w.wait_timeout(Duration::ZERO).unwrap(), vec![2; 3]);
        assert_fast(t, "a wait on a done handle");
    });
}

#[test]
fn mesh_groups_reduce_over_their_own_ranks() {
    // world 4 = 2 replicate x 2 shard: shard groups {0,1},{2,3}; replicate {0,2},{1,3}.
    let got = run(4, Duration::from_secs(30), |r| {
        let mesh = r.mesh(2).unwrap();
        let me = r.rank() as i64;
        assert_eq!(
            (mesh.world_rank(), mesh.world_size(), mesh.shard_size()),
            (r.rank(), 4, 2)
        );
        let s = mesh
            .shard_group()
            .all_reduce(vec![me], ReduceOp::Sum)
            .wait()
            .unwrap()[0];
        let p = mesh
            .replicate_group()
            .all_reduce(vec![me], ReduceOp::Sum)
            .wait()
            .unwrap()[0];
        // Each group names its members by world rank, itself by them, and
        // knows this rank's place in it.
        let (sg, rg) = (mesh.shard_group(), mesh.replicate_group());
        let (shard, replicate) = (sg.world_ranks().to_vec(), rg.world_ranks().to_vec());
        assert_eq!(sg.name(), format!("ranks{shard:?}"));
        assert_eq!(r.world().name(), "world");
        assert_eq!((sg.rank(), rg.rank()), (r.rank() % 2, r.rank() / 2));
        (s, p, shard, replicate)
    });
    let want =
        |s, p, shard: [usize; 2], replicate: [usize; 2]| (s, p, shard.to_vec(), replicate.to_vec());
    assert_eq!(
        got,
        vec![
            want(1, 2, [0, 1], [0, 2]),
            want(1, 4, [0, 1], [1, 3]),
            want(5, 2, [2, 3], [0, 2]),
            want(5, 4, [2, 3], [1, 3]),
        ]
    );
    let e = run(3, Duration::from_secs(30), |r| {
        r.mesh(2).err().unwrap().to_string()
    });
    assert!(
        e[0].contains("shard_size must divide the world size 3"),
        "{}",
        e[0]
    );
}

fn assert_fast(t: Instant, what: &str) {
    assert!(
        t.elapsed() < Duration::from_secs(5),
        "{what} took {:?}",
        t.elapsed()
    );
}

#[test]
fn a_rank_that_dies_fails_its_peers_within_seconds_naming_it() {
    let t = Instant::now();
    let got = run(3, Duration::from_secs(120), |r| {
        let g = r.world();
        g.all_reduce(vec![1.0f32; 8], ReduceOp::Sum).wait().unwrap();
        if r.rank() == 2 {
            // Dies between collectives: its handles drop as the thread ends.
            return None;
        }
        Some(
            g.all_reduce(vec![1.0f32; 8], ReduceOp::Sum)
                .wait()
                .unwrap_err(),
        )
    });
    assert_fast(t, "dead-rank detection");
    for e in got.into_iter().flatten() {
        assert!(matches!(e, CommError::RankDied { rank: 2, .. }), "{e}");
        assert!(
            e.to_string().starts_with(
                "rank 2 of group `world` died or left the group during all_reduce(f32 x 8, Sum)"
            ),
            "{e}"
        );
    }
}

#[test]
fn a_panicking_rank_mid_collective_fails_its_peers() {
    let t = Instant::now();
    let ranks = local::world_with_timeout(2, Duration::from_secs(120));
    let errs = std::thread::scope(|s| {
        let hs: Vec<_> = ranks
            .into_iter()
            .map(|r| {
                s.spawn(move || {
                    if r.rank() == 1 {
                        panic!("rank 1 fails in its forward");
                    }
                    r.world()
                        .all_gather(vec![1u8; 3], Vec::new())
                        .wait()
                        .unwrap_err()
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join()).collect::<Vec<_>>()
    });
    assert_fast(t, "panic detection");
    assert!(errs[1].is_err(), "rank 1 panicked");
    let e = errs.into_iter().next().unwrap().unwrap();
    assert!(matches!(e, CommError::RankDied { rank: 1, .. }), "{e}");
}

#[test]
fn different_collectives_at_one_position_name_both_calls() {
    let t = Instant::now();
    let got = run(2, Duration::from_secs(120), |r| {
        let g = r.world();
        if r.rank() == 0 {
            g.all_reduce(vec![0f32; 10], ReduceOp::Sum)
                .wait()
                .unwrap_err()
                .to_string()
        } else {
            g.all_gather(vec![0f32; 10], Vec::new())
                .wait()
                .unwrap_err()
                .to_string()
        }
    });
    assert_fast(t, "mismatch detection");
    for e in got {
        assert!(
            e.contains("collective mismatch on group `world` at call #0"),
            "{e}"
        );
        assert!(
            e.contains("all_reduce(f32 x 10, Sum)") && e.contains("all_gather(f32 x 10)"),
            "{e}"
        );
    }
}

#[test]
fn same_collective_with_other_sizes_or_dtypes_names_both() {
    // Two worlds: after a mismatch a rank has left its group (see
    // `a_rank_whose_collective_failed_leaves_the_group`).
    let sizes = run(2, Duration::from_secs(120), |r| {
        r.world()
            .all_reduce(vec![0f32; 10 + r.rank() * 2], ReduceOp::Sum)
            .wait()
            .unwrap_err()
            .to_string()
    });
    for size in sizes {
        assert!(
            size.contains("f32 x 10, Sum") && size.contains("f32 x 12, Sum"),
            "{size}"
        );
    }
    let dtypes = run(2, Duration::from_secs(120), |r| {
        let g = r.world();
        if r.rank() == 0 {
            g.broadcast(vec![0f32; 4], 0)
                .wait()
                .unwrap_err()
                .to_string()
        } else {
            g.broadcast(vec![0f64; 4], 0)
                .wait()
                .unwrap_err()
                .to_string()
        }
    });
    for dtype in dtypes {
        assert!(
            dtype.contains("broadcast(f32 x 4, root 0)")
                && dtype.contains("broadcast(f64 x 4, root 0)"),
            "{dtype}"
        );
    }
}

#[test]
fn all_to_all_inputs_of_other_lengths_or_another_op_name_both_calls() {
    // Every rank's input is cut alike: one of another length would send
    // pieces its peers do not expect.
    let lengths = run(2, Duration::from_secs(120), |r| {
        let input = vec![0u8; 8 + r.rank()];
        let e = r.world().all_to_all(input, Vec::new()).wait().unwrap_err();
        e.to_string()
    });
    for e in lengths {
        assert!(
            e.contains("all_to_all(u8 x 8)") && e.contains("all_to_all(u8 x 9)"),
            "{e}"
        );
    }
    let ops = run(2, Duration::from_secs(120), |r| {
        let g = r.world();
        let e = match r.rank() {
            0 => g.all_to_all(vec![0f32; 6], Vec::new()).wait().map(|_| ()),
            _ => g
                .reduce_scatter(vec![0f32; 6], Vec::new(), ReduceOp::Avg)
                .wait()
                .map(|_| ()),
        };
        e.unwrap_err().to_string()
    });
    for e in ops {
        assert!(
            e.contains("all_to_all(f32 x 6)") && e.contains("reduce_scatter(f32 x 6, Avg)"),
            "{e}"
        );
    }
}

#[test]
fn gathers_of_other_lengths_name_both_calls_unless_they_are_all_gather_v() {
    // all_gather parts must agree in length; in place, the whole buffers;
    // and a gather never pairs with a gather of another kind.
    let cases: [(&str, &str); 3] = [
        ("all_gather(i64 x 1)", "all_gather(i64 x 6)"),
        (
            "all_gather_in_place(i64 x 10)",
            "all_gather_in_place(i64 x 11)",
        ),
        ("all_gather(i64 x 3)", "all_gather_v(i64 x 3)"),
    ];
    for (case, (a, b)) in cases.into_iter().enumerate() {
        let got = run(2, Duration::from_secs(120), |r| {
            let g = r.world();
            let one = r.rank() == 1;
            let e = match (case, one) {
                (0, _) => g
                    .all_gather(vec![0i64; if one { 6 } else { 1 }], Vec::new())
                    .wait()
                    .map(|_| ()),
                (1, _) => g
                    .all_gather_in_place(vec![0i64; if one { 11 } else { 10 }])
                    .wait()
                    .map(|_| ()),
                (_, false) => g.all_gather(vec![0i64; 3], Vec::new()).wait().map(|_| ()),
                (_, true) => g.all_gather_v(vec![0i64; 3], Vec::new()).wait().map(|_| ()),
            };
            e.unwrap_err().to_string()
        });
        for e in got {
            assert!(
                e.contains("collective mismatch") && e.contains(a) && e.contains(b),
                "case {case}: {e}"
            );
        }
    }
    // Parts of different lengths are what all_gather_v is for.
    let got = run(3, Duration::from_secs(120), |r| {
        let mine = vec![r.rank() as i64; r.rank()];
        r.world().all_gather_v(mine, Vec::new()).wait().unwrap().1
    });
    for g in got {
        assert_eq!(g, [1, 2, 2]);
    }
}

#[test]
fn a_rank_whose_collective_failed_leaves_the_group() {
    // Rank 0 times out waiting for rank 1, then calls again; rank 1 arrives
    // late. As on shm and tcp, rank 0's later call is not run, and rank 1
    // learns that rank 0 left instead of waiting out its timeout.
    let t = Instant::now();
    let got = run(2, Duration::from_millis(400), |r| {
        let g = r.world();
        if r.rank() == 0 {
            let first = g.all_gather(vec![7u8; 2], Vec::new()).wait().unwrap_err();
            let second = g.all_gather(vec![7u8; 2], Vec::new()).wait().unwrap_err();
            return vec![first.to_string(), second.to_string()];
        }
        std::thread::sleep(Duration::from_millis(700));
        // Rank 0 posted its part of call #0 before it gave up: the data is
        // whole, so this call may still complete, correctly.
        let first = match g.all_gather(vec![1u8; 2], Vec::new()).wait() {
            Ok((_, out)) => {
                assert_eq!(out, [7, 7, 1, 1]);
                "ok".to_string()
            }
            Err(e) => e.to_string(),
        };
        let second = g.all_gather(vec![1u8; 2], Vec::new()).wait().unwrap_err();
        vec![first, second.to_string()]
    });
    assert!(t.elapsed() < Duration::from_secs(3), "{:?}", t.elapsed());
    assert!(
        got[0][0].contains("timed out") && got[0][0].contains("[1]"),
        "{}",
        got[0][0]
    );
    assert!(
        got[0][1].starts_with("all_gather(u8 x 2) on group `world` was not run")
            && got[0][1].contains("timed out"),
        "{}",
        got[0][1]
    );
    for e in &got[1] {
        assert!(
            e == "ok" || e.starts_with("rank 0 of group `world` died or left the group"),
            "{e}"
        );
    }
    assert!(
        got[1][1].starts_with("rank 0 of group `world` died or left"),
        "{}",
        got[1][1]
    );
}

#[test]
fn a_stuck_rank_times_out_naming_who_is_missing() {
    let t = Instant::now();
    let got = run(3, Duration::from_millis(300), |r| {
        if r.rank() == 1 {
            // Alive but never calls: only a timeout can end the wait.
            std::thread::sleep(Duration::from_millis(800));
            return None;
        }
        Some(r.world().barrier().wait().unwrap_err())
    });
    assert!(t.elapsed() < Duration::from_secs(5));
    for e in got.into_iter().flatten() {
        match &e {
            CommError::Timeout { waiting_for, .. } => assert!(waiting_for.contains(&1), "{e}"),
            // The other caller may see rank 1 leave after its sleep instead.
            CommError::RankDied { rank: 1, .. } => {}
            _ => panic!("unexpected {e}"),
        }
        assert!(e.to_string().contains("barrier()"), "{e}");
    }
}

#[test]
fn bad_arguments_fail_at_once() {
    run(2, Duration::from_secs(30), |r| {
        let g = r.world();
        let e = g.broadcast(vec![0u8; 1], 5).wait().unwrap_err().to_string();
        assert!(e.contains("root 5 is not a rank of this group of 2"), "{e}");
        let e = g
            .send(vec![0u8; 1], g.rank())
            .wait()
            .unwrap_err()
            .to_string();
        assert!(e.contains("must be another rank"), "{e}");
        let e = r.new_group(&[0, 7]).err().unwrap().to_string();
        assert!(e.contains("rank 7 is not in the world of 2 ranks"), "{e}");
    });
}

#[test]
fn a_timeout_too_long_for_the_clock_waits_instead_of_panicking() {
    // `Duration::MAX` (or ZRT_TIMEOUT=1e19) reads "wait long": every
    // deadline saturates instead of overflowing the clock.
    let sums = run(2, Duration::MAX, |r| {
        let g = r.world();
        g.barrier().wait().unwrap();
        g.all_reduce(vec![r.rank() as f32 + 1.0; 3], ReduceOp::Sum)
            .wait()
            .unwrap()
    });
    assert_eq!(sums, vec![vec![3.0f32; 3]; 2]);
}

//! The local (threads) backend with real ranks: every op x dtype x world size
//! x sizes that do not divide evenly, against a naive reference; and every
//! fault, each finishing in bounded time with an error that names it.

use std::time::{Duration, Instant};

use half::{bf16, f16};
use zrt_collectives::local::{self, LocalRank};
use zrt_collectives::{chunk_range, CommError, Element, ProcessGroup, ReduceOp};

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

/// Test values of each element type, and the reference result of a reduction
/// computed independently of the backend (in i64 / f64).
trait Make: Element {
    fn make(x: i64) -> Self;
    fn expect(xs: &[i64], op: ReduceOp) -> Self;
}

macro_rules! make_float {
    ($t:ty, $from:expr) => {
        impl Make for $t {
            fn make(x: i64) -> Self {
                $from(x as f64)
            }
            fn expect(xs: &[i64], op: ReduceOp) -> Self {
                let sum: i64 = xs.iter().sum();
                $from(match op {
                    ReduceOp::Sum => sum as f64,
                    ReduceOp::Avg => sum as f64 / xs.len() as f64,
                    ReduceOp::Max => *xs.iter().max().unwrap() as f64,
                    ReduceOp::Min => *xs.iter().min().unwrap() as f64,
                })
            }
        }
    };
}
make_float!(f32, |x: f64| x as f32);
make_float!(f64, |x: f64| x);
make_float!(bf16, bf16::from_f64);
make_float!(f16, f16::from_f64);

macro_rules! make_int {
    ($t:ty) => {
        impl Make for $t {
            fn make(x: i64) -> Self {
                x as $t
            }
            fn expect(xs: &[i64], op: ReduceOp) -> Self {
                let sum: i64 = xs.iter().sum();
                (match op {
                    ReduceOp::Sum => sum,
                    ReduceOp::Avg => sum / xs.len() as i64,
                    ReduceOp::Max => *xs.iter().max().unwrap(),
                    ReduceOp::Min => *xs.iter().min().unwrap(),
                }) as $t
            }
        }
    };
}
make_int!(i64);
make_int!(u8);

/// Rank `r`'s i-th input: small non-negative integers, exact in every type.
fn val(r: usize, i: usize) -> i64 {
    ((r * 7 + i * 3) % 11) as i64
}

fn check_all_ops<T: Make>() {
    let ops = [ReduceOp::Sum, ReduceOp::Avg, ReduceOp::Max, ReduceOp::Min];
    for world in [2usize, 3, 4] {
        for len in [1usize, 7, 64, 1001] {
            let per_rank = run(world, Duration::from_secs(30), |r| {
                let g = r.world();
                let me = r.rank();
                let input: Vec<T> = (0..len).map(|i| T::make(val(me, i))).collect();
                let mut got = Vec::new();
                for op in ops {
                    got.push(g.all_reduce(input.clone(), op).wait().unwrap());
                    let (back, out) = g
                        .reduce_scatter(input.clone(), Vec::new(), op)
                        .wait()
                        .unwrap();
                    assert_eq!(back.len(), len);
                    got.push(out);
                }
                // all_gather of unequal parts: rank r contributes len + r elements.
                let part: Vec<T> = (0..len + me).map(|i| T::make(val(me, i))).collect();
                got.push(g.all_gather(part, Vec::new()).wait().unwrap().1);
                let b: Vec<T> = if me == world - 1 {
                    input.clone()
                } else {
                    vec![T::ZERO; len]
                };
                got.push(g.broadcast(b, world - 1).wait().unwrap());
                g.barrier().wait().unwrap();
                got
            });
            for (me, got) in per_rank.iter().enumerate() {
                let column = |i: usize| -> Vec<i64> { (0..world).map(|r| val(r, i)).collect() };
                for (k, op) in ops.iter().enumerate() {
                    let full: Vec<T> = (0..len).map(|i| T::expect(&column(i), *op)).collect();
                    assert_eq!(
                        got[2 * k],
                        full,
                        "{:?} all_reduce {op:?} world {world} len {len} rank {me}",
                        T::DTYPE
                    );
                    let part = &full[chunk_range(len, world, me)];
                    assert_eq!(
                        &got[2 * k + 1][..],
                        part,
                        "{:?} reduce_scatter {op:?} world {world} len {len}",
                        T::DTYPE
                    );
                }
                let gathered: Vec<T> = (0..world)
                    .flat_map(|r| (0..len + r).map(move |i| T::make(val(r, i))))
                    .collect();
                assert_eq!(
                    got[8],
                    gathered,
                    "{:?} all_gather world {world} len {len}",
                    T::DTYPE
                );
                let bcast: Vec<T> = (0..len).map(|i| T::make(val(world - 1, i))).collect();
                assert_eq!(
                    got[9],
                    bcast,
                    "{:?} broadcast world {world} len {len}",
                    T::DTYPE
                );
            }
        }
    }
}

#[test]
fn every_op_f32() {
    check_all_ops::<f32>();
}
#[test]
fn every_op_bf16() {
    check_all_ops::<bf16>();
}
#[test]
fn every_op_f16() {
    check_all_ops::<f16>();
}
#[test]
fn every_op_f64() {
    check_all_ops::<f64>();
}
#[test]
fn every_op_i64() {
    check_all_ops::<i64>();
}
#[test]
fn every_op_u8() {
    check_all_ops::<u8>();
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
fn mesh_groups_reduce_over_their_own_ranks() {
    // world 4 = 2 replicate x 2 shard: shard groups {0,1},{2,3}; replicate {0,2},{1,3}.
    let got = run(4, Duration::from_secs(30), |r| {
        let mesh = r.mesh(2).unwrap();
        let me = r.rank() as i64;
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
        (s, p)
    });
    assert_eq!(got, vec![(1, 2), (1, 4), (5, 2), (5, 4)]);
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
    let got = run(2, Duration::from_secs(120), |r| {
        let g = r.world();
        let size = g
            .all_reduce(vec![0f32; 10 + r.rank() * 2], ReduceOp::Sum)
            .wait()
            .unwrap_err()
            .to_string();
        let dtype = if r.rank() == 0 {
            g.broadcast(vec![0f32; 4], 0)
                .wait()
                .unwrap_err()
                .to_string()
        } else {
            g.broadcast(vec![0f64; 4], 0)
                .wait()
                .unwrap_err()
                .to_string()
        };
        (size, dtype)
    });
    for (size, dtype) in got {
        assert!(
            size.contains("f32 x 10, Sum") && size.contains("f32 x 12, Sum"),
            "{size}"
        );
        assert!(
            dtype.contains("broadcast(f32 x 4, root 0)")
                && dtype.contains("broadcast(f64 x 4, root 0)"),
            "{dtype}"
        );
    }
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

use super::*;
use std::time::Instant;

use super::ring::{claim_bufs, ring_bufs, window_len, MAX_LAPS, MIN_SLOT_BYTES};
use crate::ProcessGroup;

#[test]
fn windows_fit_their_slot_for_any_group_and_dtype() {
    for wanted in [0, 4096, 5000, DEFAULT_SLOT_BYTES] {
        for n in 1..=64 {
            let slot = slot_bytes_for(wanted, n);
            assert!(slot >= wanted && slot % 64 == 0, "{wanted} {n}: {slot}");
            for size in [1, 2, 4, 8] {
                // Reductions: n parts in 3 buffers; gathers: 1 in 2.
                for (parts, bufs) in [(n, 3), (1, 2)] {
                    let w = window_len(slot, size, parts, bufs);
                    assert!(
                        w % 16 == 0 && w * parts * bufs * size <= slot,
                        "slot {slot} n {n} size {size}: window {w}"
                    );
                    // And the largest that fits: fewer, longer windows
                    // mean fewer barriers.
                    assert!(
                        (w + 16) * parts * bufs * size > slot,
                        "slot {slot} n {n} size {size}: window {w} could be longer"
                    );
                }
            }
        }
    }
}

#[test]
fn a_ring_spans_twice_a_cores_cache_of_what_one_peer_reads() {
    let (kib, mib) = (1 << 10, 1 << 20);
    // 2 ranks, 512 KiB slots, 1 MiB of L2: 4 slots (2 MiB).
    assert_eq!(ring_laps(512 * kib, 2, mib), 4);
    // A peer reads 2 rings a lap with 3 ranks, 4 with 5.
    assert_eq!(ring_laps(512 * kib, 3, mib), 2);
    assert_eq!(ring_laps(512 * kib, 5, mib), 1);
    assert_eq!(ring_laps(512 * kib, 64, mib), 1);
    assert_eq!(ring_laps(512 * kib, 2, 2 * mib), 8);
    assert_eq!(ring_laps(512 * kib, 1, mib), 1);
    // Small slots: at most MAX_LAPS; large ones: one.
    assert_eq!(ring_laps(4 * kib, 2, mib), MAX_LAPS);
    assert_eq!(ring_laps(8 * mib, 2, mib), 1);
}

#[test]
fn operations_walk_the_ring_and_no_round_reuses_a_buffer_too_soon() {
    let slot = slot_bytes_for(5000, 3);
    for laps in [1, 2, 5] {
        let ring = slot * laps;
        let mut at = 0;
        let mut used = std::collections::BTreeSet::new();
        let mut last_end = 0;
        // Operations of every buffering, element size and length, in
        // an irregular order, as a training step issues them.
        for k in 0..500usize {
            let bufs = [2, 3][k % 2];
            let size = [4, 2, 8, 1, 4][k % 5];
            let rounds = [1, 2, 7, 3, 40, 1, 5][k % 7];
            let c = claim_bufs(&mut at, slot, laps, size, bufs, rounds);
            assert_eq!((c.len, c.per), ring_bufs(slot, laps, size, bufs));
            assert!(c.per >= bufs * laps, "{laps} {bufs} {size}: {c:?}");
            let bytes = |j: usize| c.at(j) * size..(c.at(j) + c.len) * size;
            // Where the previous operation ended, unless that was the
            // end of the ring.
            if bytes(0).start != 0 {
                assert!(bytes(0).start >= last_end, "op {k}");
            }
            for j in 0..rounds {
                let r = bytes(j);
                assert!(r.end <= ring, "op {k} round {j}: {r:?} past {ring}");
                used.insert(r.start);
                // The rounds the buffering protects never share a byte.
                for d in 1..bufs.min(rounds - j) {
                    let q = bytes(j + d);
                    assert!(
                        r.end <= q.start || q.end <= r.start,
                        "op {k}: {j} and {}",
                        j + d
                    );
                }
            }
            last_end = bytes(rounds - 1).end;
        }
        // Every lap was written, not only the first.
        assert!(
            used.iter().any(|&b| b >= ring - slot),
            "laps {laps}: {used:?}"
        );
        // One-round operations take the ring's buffers in turn.
        let (_, per) = ring_bufs(slot, laps, 4, 2);
        let mut at = 0;
        let firsts: Vec<usize> = (0..2 * per)
            .map(|_| claim_bufs(&mut at, slot, laps, 4, 2, 1).first)
            .collect();
        let turns: Vec<usize> = (0..2 * per).map(|k| k % per).collect();
        assert_eq!(firsts, turns, "laps {laps}");
    }
}

/// A waiting rank really sleeps (a futex on the wrong address returns
/// at once, and the rank would spin on a core its peer needs), wakes
/// when the word is no longer what it saw, and is woken by `wake_all`.
#[cfg(target_os = "linux")]
#[test]
fn a_futex_sleeper_sleeps_until_woken() {
    let word = AtomicU64::new(5);
    let t = Instant::now();
    futex::wait(&word, 5, Duration::from_millis(200));
    assert!(
        t.elapsed() >= Duration::from_millis(150),
        "{:?}",
        t.elapsed()
    );
    let t = Instant::now();
    futex::wait(&word, 6, Duration::from_secs(5));
    assert!(t.elapsed() < Duration::from_secs(2), "{:?}", t.elapsed());
    std::thread::scope(|s| {
        let t = Instant::now();
        let sleeper = s.spawn(|| futex::wait(&word, 5, Duration::from_secs(10)));
        // Woken again and again: the sleeper may not be asleep yet.
        while !sleeper.is_finished() {
            assert!(t.elapsed() < Duration::from_secs(5), "wake_all woke nobody");
            futex::wake_all(&word);
            std::thread::sleep(Duration::from_millis(10));
        }
    });
}

/// Runs `f` on two ranks (threads) of a new shm group `name` with
/// 64 KiB slots written under `stores`; each rank's result, in order.
fn on_two_ranks<R: Send>(
    name: &str,
    stores: SlotStores,
    f: impl Fn(usize, &ShmGroup) -> R + Sync,
) -> Vec<R> {
    let srv = crate::store::StoreServer::serve("127.0.0.1:0", "tok").unwrap();
    let store = StoreClient::connect(&srv.addr().to_string(), "tok", Duration::from_secs(5));
    let store = Arc::new(store.unwrap());
    let job = format!("two-{}", std::process::id());
    std::thread::scope(|sc| {
        let handles: Vec<_> = (0..2)
            .map(|r| {
                let (store, job, f) = (store.clone(), &job, &f);
                sc.spawn(move || {
                    let g = ShmGroup::join(ShmJoin {
                        store,
                        job,
                        name,
                        world_ranks: vec![0, 1],
                        world_rank: r,
                        slot_bytes: 64 << 10,
                        slot_stores: stores,
                        timeout: Duration::from_secs(20),
                    })
                    .unwrap();
                    f(r, &g)
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

/// Streaming stores into the slots move the same bytes as plain ones:
/// two ranks (threads) run every staged operation (and a broadcast), over many rounds and
/// with parts that do not divide evenly, under each fixed policy, and
/// the results equal a reference computed here.
#[test]
fn streaming_and_plain_slot_stores_give_the_same_results() {
    let len = 50_003; // 200 KB: many 64 KiB-slot rounds, uneven parts
    let inputs: Vec<Vec<f32>> = (0..2)
        .map(|r| {
            (0..len)
                .map(|i| ((i * 7 + r * 13) % 1000) as f32 * 0.25)
                .collect()
        })
        .collect();
    let input = |r: usize| inputs[r].clone();
    let sum: Vec<f32> = (0..len).map(|i| inputs[0][i] + inputs[1][i]).collect();
    let half = |r: usize| chunk_range(len, 2, r);
    for (name, stores) in [("plain", SlotStores::Plain), ("nt", SlotStores::Streaming)] {
        let results = on_two_ranks(name, stores, |r, g| {
            let all = g.all_reduce(input(r), ReduceOp::Sum).wait().unwrap();
            let (_, part) = g
                .reduce_scatter(input(r), Vec::new(), ReduceOp::Sum)
                .wait()
                .unwrap();
            let in_place = g
                .reduce_scatter_in_place(input(r), ReduceOp::Sum)
                .wait()
                .unwrap();
            // Parts of equal length (all_gather's rule): 25001 each.
            let mine = input(r)[r * 25_001..(r + 1) * 25_001].to_vec();
            let (_, gathered) = g.all_gather(mine, Vec::new()).wait().unwrap();
            let mut buf = vec![0.0; len];
            buf[half(r)].copy_from_slice(&input(r)[half(r)]);
            let gathered_in_place = g.all_gather_in_place(buf).wait().unwrap();
            let sent = g.broadcast(input(1), 1).wait().unwrap();
            assert!(sent == input(1), "{name}: rank {r}'s broadcast from rank 1");
            (
                all,
                part,
                in_place[half(r)].to_vec(),
                gathered,
                gathered_in_place,
            )
        });
        // Each rank's gathered part is its own input's.
        let gathered: Vec<f32> = (0..2)
            .flat_map(|r| input(r)[r * 25_001..(r + 1) * 25_001].to_vec())
            .collect();
        let halves: Vec<f32> = (0..2).flat_map(|r| input(r)[half(r)].to_vec()).collect();
        for (r, (all, part, in_place, g, g_in_place)) in results.into_iter().enumerate() {
            assert!(all == sum, "{name}: rank {r}'s all_reduce");
            assert!(part == sum[half(r)], "{name}: rank {r}'s reduce_scatter");
            assert!(
                in_place == sum[half(r)],
                "{name}: rank {r}'s in-place reduce_scatter"
            );
            assert!(g == gathered, "{name}: rank {r}'s all_gather");
            assert!(
                g_in_place == halves,
                "{name}: rank {r}'s in-place all_gather"
            );
        }
    }
}

/// What `auto` measures to choose its stores: every byte a rank wrote
/// into shared memory and read out of it, per operation kind.
#[test]
fn a_rank_counts_the_bytes_it_writes_into_and_reads_from_shared_memory() {
    let len = 50_003;
    let counted = on_two_ranks("counts", SlotStores::Auto, |_, g| {
        let counts = || g.front.inner.state.lock().stores.pending_bytes();
        let mut seen = vec![counts()];
        g.all_gather(vec![1f32; 25_001], Vec::new()).wait().unwrap();
        seen.push(counts());
        let v = vec![1f32; len];
        g.reduce_scatter(v.clone(), Vec::new(), ReduceOp::Sum)
            .wait()
            .unwrap();
        seen.push(counts());
        g.all_reduce(v, ReduceOp::Sum).wait().unwrap();
        seen.push(counts());
        // One round (a 1 KiB gather): not counted.
        g.all_gather(vec![1f32; 256], Vec::new()).wait().unwrap();
        seen.push(counts());
        seen
    });
    for (r, seen) in counted.iter().enumerate() {
        let own = 4 * chunk_range(len, 2, r).len();
        let peer = 4 * chunk_range(len, 2, 1 - r).len();
        let gather = (100_004, 100_004);
        // reduce_scatter stages the peer's part, reduces its own from
        // the peer's slot; all_reduce also writes its own part's result
        // and reads both results.
        let scatter = (gather.0 + peer, gather.1 + own);
        let all = (scatter.0 + peer + own, scatter.1 + 3 * own);
        // A trial takes plain and streaming stores in turn: the
        // gather and the all_reduce plain, the reduce_scatter streamed.
        let none = (0, 0);
        let streamed = (scatter.0 - gather.0, scatter.1 - gather.1);
        let plain = (all.0 - streamed.0, all.1 - streamed.1);
        assert_eq!(
            seen,
            &[
                (none, none),
                (gather, none),
                (gather, streamed),
                (plain, streamed),
                (plain, streamed)
            ],
            "rank {r}"
        );
    }
}

/// A group's operations take the next buffers along its ring, the same
/// on every rank: one-round operations, whatever their buffering and
/// element type, each start past the previous one's buffer.
#[test]
fn a_groups_operations_walk_its_ring_in_step_on_every_rank() {
    let seen = on_two_ranks("ring", SlotStores::Plain, |_, g| {
        let inner = &g.front.inner;
        let at = || inner.state.lock().ring_at;
        let mut seen = vec![at()];
        for k in 0..6 {
            match k % 3 {
                0 => drop(g.all_gather(vec![1f32; 100], Vec::new()).wait().unwrap()),
                1 => drop(g.all_reduce(vec![1f64; 100], ReduceOp::Sum).wait().unwrap()),
                _ => drop(g.all_gather(vec![1u8; 100], Vec::new()).wait().unwrap()),
            }
            seen.push(at());
        }
        (seen, inner.seg.slot, inner.seg.laps)
    });
    let (positions, slot, laps) = &seen[0];
    assert_eq!(&seen[1].0, positions, "the ranks walk their rings apart");
    assert_eq!(
        *laps,
        ring_laps(*slot, 2, crate::caches::core_cache_bytes())
    );
    assert!(*laps >= 4, "a ring of {laps} slots of {slot} bytes");
    // One f32 gather buffer (half a slot) from the start, then on.
    assert_eq!(positions[..2], [0, slot / 2]);
    assert!(positions.windows(2).all(|w| w[1] > w[0]), "{positions:?}");
}

#[test]
fn a_join_a_rank_never_comes_to_fails_naming_it_and_leaves_no_segment() {
    let srv = crate::store::StoreServer::serve("127.0.0.1:0", "tok").unwrap();
    let store = StoreClient::connect(&srv.addr().to_string(), "tok", Duration::from_secs(5));
    let store = Arc::new(store.unwrap());
    let job = format!("unit-{}", std::process::id());
    let path = format!("/dev/shm/zrt-{job}-lonely");
    let join = |name, world_rank| {
        ShmGroup::join(ShmJoin {
            store: store.clone(),
            job: &job,
            name,
            world_ranks: vec![4, 9],
            world_rank,
            slot_bytes: 4096,
            slot_stores: SlotStores::Auto,
            timeout: Duration::from_millis(300),
        })
    };
    // Rank 0 (world rank 4) made the segment, then waited for rank 9.
    let e = join("lonely", 4).err().unwrap().to_string();
    assert!(
        e.starts_with("rendezvous failed: rank 9 did not join shared-memory group `lonely` within 300ms: check that rank's output"),
        "{e}"
    );
    assert!(!std::path::Path::new(&path).exists(), "{path} left behind");
    // Group rank 1 (world rank 9) waited for rank 4 to make one.
    let e = join("empty", 9).err().unwrap().to_string();
    assert!(
        e.starts_with(
            "rendezvous failed: rank 4 did not create shared-memory group `empty` within 300ms"
        ),
        "{e}"
    );
    // Rank 4 made the segment and was killed: rank 9 maps it, waits
    // for rank 4's pid, and removes the name on its way out.
    let slot = slot_bytes_for(4096, 2);
    // A segment as rank 4 would have made it: a file holding `laps`
    // slots per rank, and the layout published (`published` slots).
    let made = |name: &str, laps: usize, published: u64| {
        let path = format!("/dev/shm/zrt-{job}-{name}");
        let f = std::fs::File::create(&path).unwrap();
        f.set_len(Segment::bytes(2, slot, laps) as u64).unwrap();
        let layout = [slot as u64, published].map(u64::to_le_bytes).concat();
        store.set(&format!("shm/{name}/created"), &layout).unwrap();
        path
    };
    let orphan = made("orphan", 1, 1);
    let e = join("orphan", 9).err().unwrap().to_string();
    assert!(
        e.starts_with("rendezvous failed: rank 4 did not join shared-memory group `orphan`"),
        "{e}"
    );
    assert!(
        !std::path::Path::new(&orphan).exists(),
        "{orphan} left behind"
    );
    // A segment that holds less than the layout rank 0 published (a
    // ring of 4 slots in a file made for 1): refused before any rank
    // indexes past its end, and removed.
    let short = made("short", 1, 4);
    let e = join("short", 9).err().unwrap().to_string();
    let (has, needs) = (Segment::bytes(2, slot, 1), Segment::bytes(2, slot, 4));
    assert_eq!(
        e,
        format!("rendezvous failed: {short} holds {has} bytes, the group's layout needs {needs}")
    );
    assert!(
        !std::path::Path::new(&short).exists(),
        "{short} left behind"
    );
    // Had rank 4's process ended, its store connection would have said
    // so: the wait ends at once instead of at the timeout.
    store.set("gone/4", b"").unwrap();
    let join = |name| {
        ShmGroup::join(ShmJoin {
            store: store.clone(),
            job: &job,
            name,
            world_ranks: vec![4, 9],
            world_rank: 9,
            slot_bytes: 4096,
            slot_stores: SlotStores::Auto,
            timeout: Duration::from_secs(60),
        })
    };
    let t = std::time::Instant::now();
    let e = join("ended").err().unwrap().to_string();
    assert!(
        e.starts_with("rendezvous failed: rank 4 left the job before it could create shared-memory group `ended`: its process exited, died or dropped its `Dist`"),
        "{e}"
    );
    assert!(t.elapsed() < Duration::from_secs(5), "{:?}", t.elapsed());
}

#[test]
fn slot_sizes_from_the_environment_are_checked() {
    let parse =
        |v| crate::env_bytes::parse("ZRT_SHM_SLOT_BYTES", v, DEFAULT_SLOT_BYTES, MIN_SLOT_BYTES);
    // The default the README's environment table gives.
    assert_eq!(parse(None), Ok(524_288));
    assert_eq!(parse(Some("")), Ok(DEFAULT_SLOT_BYTES));
    assert_eq!(parse(Some(" 4096 ")), Ok(4096));
    for bad in ["512k", "100", "-1", "x", "2000000000"] {
        let e = parse(Some(bad)).unwrap_err();
        assert!(e.contains(&format!("ZRT_SHM_SLOT_BYTES={bad:?}")), "{e}");
        assert!(
            e.contains("from 4096 to 1073741824 (e.g. ZRT_SHM_SLOT_BYTES=524288, the default)"),
            "{e}"
        );
    }
}

//! The world's rendezvous: every rank claims its `RANK`, publishes its
//! `WORLD_SIZE` and host, and reads every rank's.
//!
//! Launch mistakes show up here. Two nodes given the same `--node-rank`
//! start a rank twice, and the two processes would act as one rank;
//! launchers given different `--nnodes` or `--nproc-per-node` start ranks
//! that disagree on the world, and some of them would wait out their whole
//! timeout (300 s by default) for a rank that never comes. The rank that
//! finds such a mistake writes it under [`ABORT`], which every rank watches
//! while it waits, so the whole job fails at once, every rank naming the
//! cause. A rank that claimed its `RANK` and then ended (a crash between
//! connecting and meeting) is named at once too: its store connection
//! sets its [`gone_key`] when it closes. A rank that never connects (its
//! node's launcher not started, a crash before it reached the store) no
//! process here can see: rank 0 says whom it still waits for every so
//! often ([`StillWaiting`]) until the timeout names them.

use std::time::{Duration, Instant};

use crate::still_waiting::StillWaiting;
use crate::store::{gone_key, Awaited, StoreClient};
use crate::CommError;

/// The key under which a rank that found a launch mistake says what it is.
const ABORT: &str = "abort";

/// Rank `rank` of a world of `world` ranks on `host` meets the others:
/// returns every rank's host, in rank order. Fails (and makes every rank
/// fail) when a rank is started twice or ranks disagree on the world
/// size, and names the rank that did not come within `timeout`.
pub(crate) fn meet(
    store: &StoreClient,
    rank: usize,
    world: usize,
    host: &str,
    timeout: Duration,
) -> Result<Vec<String>, CommError> {
    // Every rank waits for the same missing ranks; the first one's word
    // is enough at the default level. A warning: `zrt::init_logging`
    // shows the collectives' warnings only, and ten seconds at the
    // rendezvous is seldom meant.
    let say = |m: String| {
        if rank == 0 {
            tracing::warn!("{m}");
        } else {
            tracing::debug!("{m}");
        }
    };
    meet_saying(store, rank, world, host, timeout, StillWaiting::new(), say)
}

/// [`meet`], saying through `say` whom it still waits for when `waits`
/// has a report due.
fn meet_saying(
    store: &StoreClient,
    rank: usize,
    world: usize,
    host: &str,
    timeout: Duration,
    mut waits: StillWaiting,
    mut say: impl FnMut(String),
) -> Result<Vec<String>, CommError> {
    let abort = |why: String| {
        // Best effort: should the store be gone, this rank still fails
        // with `why`, and its peers with the lost store.
        let _ = store.set(ABORT, why.as_bytes());
        CommError::Rendezvous(why)
    };
    if store.add(&format!("claim/{rank}"), 1)? > 1 {
        return Err(abort(format!(
            "RANK={rank} was started twice in this job: give each node's launcher its own --node-rank (0 to --nnodes - 1), and stop any rank of an earlier job with the same MASTER_PORT and ZRT_TOKEN"
        )));
    }
    // Only the claim's winner: a duplicate's connection ending must not
    // say this rank left.
    store.set_on_close(&gone_key(rank))?;
    store.set(
        &format!("host/{rank}"),
        format!("{world} {host}").as_bytes(),
    )?;
    let deadline = crate::work::deadline_in(timeout);
    let mut hosts = Vec::with_capacity(world);
    for r in 0..world {
        let left = deadline.saturating_duration_since(Instant::now());
        let still = |waited| {
            still_waiting(store, r, world, waited, timeout)
                .map(|m| m.into_iter().for_each(&mut say))
        };
        let (host, gone) = (format!("host/{r}"), gone_key(r));
        let awaited = store.await_key_saying(&host, &[ABORT, &gone], left, &mut waits, still)?;
        let v = match awaited {
            Awaited::Value(v) => v,
            Awaited::Ended(0, why) => {
                return Err(CommError::Rendezvous(format!(
                    "another rank stopped the job: {}",
                    String::from_utf8_lossy(&why)
                )))
            }
            Awaited::Ended(..) => {
                return Err(CommError::Rendezvous(format!(
                    "rank {r} connected to the job and ended before it met the others: check that rank's output, it exited or died"
                )))
            }
            Awaited::TimedOut => {
                return Err(CommError::Rendezvous(format!(
                    "rank {r} did not join the job within {:.0} s: check that its process runs and reaches MASTER_ADDR:MASTER_PORT, and that every node's launcher was started with the same --nnodes and --nproc-per-node (WORLD_SIZE={world} here)",
                    timeout.as_secs_f64()
                )))
            }
        };
        let v = String::from_utf8_lossy(&v);
        let (w, h) = v.split_once(' ').unwrap_or(("?", &v));
        if w != world.to_string() {
            return Err(abort(format!(
                "rank {r} was started with WORLD_SIZE={w} and rank {rank} with WORLD_SIZE={world}: give every node's launcher the same --nnodes and --nproc-per-node"
            )));
        }
        hosts.push(h.to_string());
    }
    Ok(hosts)
}

/// What a rank that has met ranks `0..first` says while it waits for
/// `first` after `waited`: how many have joined and which have not
/// (nothing when all have, since it looked).
fn still_waiting(
    store: &StoreClient,
    first: usize,
    world: usize,
    waited: Duration,
    timeout: Duration,
) -> Result<Option<String>, CommError> {
    let mut missing = Vec::new();
    for r in first..world {
        if store
            .get_within(&format!("host/{r}"), Duration::ZERO)?
            .is_none()
        {
            missing.push(r);
        }
    }
    let shown: Vec<String> = missing.iter().take(8).map(usize::to_string).collect();
    let who = match missing.len() {
        0 => return Ok(None),
        1 => format!("rank {}", shown[0]),
        n if n > 8 => format!("ranks {} and {} more", shown.join(", "), n - 8),
        _ => format!("ranks {}", shown.join(", ")),
    };
    Ok(Some(format!(
        "rendezvous: {} of {world} ranks have joined after {:.0} s, waiting for {who} (is every node's launcher running, with the same MASTER_ADDR:MASTER_PORT? the wait fails at {:.0} s, ZRT_TIMEOUT)",
        world - missing.len(),
        waited.as_secs_f64(),
        timeout.as_secs_f64(),
    )))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::StoreServer;

    /// Ranks (`rank`, `world`) meeting at one store on threads, each
    /// waiting at most `timeout`: each one's result and how long it took.
    fn meet_all(
        ranks: &[(usize, usize)],
        timeout: Duration,
    ) -> Vec<(Result<Vec<String>, String>, Duration)> {
        let srv = StoreServer::serve("127.0.0.1:0", "tok").unwrap();
        let addr = srv.addr().to_string();
        std::thread::scope(|s| {
            let hs: Vec<_> = ranks
                .iter()
                .map(|&(rank, world)| {
                    let addr = addr.clone();
                    s.spawn(move || {
                        let c = StoreClient::connect(&addr, "tok", timeout).unwrap();
                        let t = Instant::now();
                        let got = meet(&c, rank, world, &format!("h{rank}"), timeout);
                        (got.map_err(|e| e.to_string()), t.elapsed())
                    })
                })
                .collect();
            hs.into_iter().map(|h| h.join().unwrap()).collect()
        })
    }

    #[test]
    fn ranks_that_agree_get_every_hosts_name_in_rank_order() {
        for (got, _) in meet_all(&[(2, 3), (0, 3), (1, 3)], Duration::from_secs(30)) {
            assert_eq!(got.unwrap(), ["h0", "h1", "h2"]);
        }
    }

    #[test]
    fn a_rank_started_twice_stops_every_rank_at_once_naming_it() {
        // Rank 2 never comes: without the abort, ranks would wait for it
        // until their timeout.
        let out = meet_all(&[(0, 3), (1, 3), (1, 3)], Duration::from_secs(30));
        for (got, took) in out {
            let e = got.unwrap_err();
            assert!(e.contains("RANK=1 was started twice in this job"), "{e}");
            assert!(took < Duration::from_secs(10), "{took:?}: {e}");
        }
    }

    #[test]
    fn ranks_started_with_different_world_sizes_stop_every_rank_naming_both() {
        // As launchers given --nproc-per-node 1 and 2 with --nnodes 2:
        // rank 0 of a world of 2, ranks 2 and 3 of a world of 4.
        let out = meet_all(&[(0, 2), (2, 4), (3, 4)], Duration::from_secs(30));
        for (got, took) in out {
            let e = got.unwrap_err();
            assert!(
                e.contains("rank 0 was started with WORLD_SIZE=2 and rank ") && e.contains(" with WORLD_SIZE=4: give every node's launcher the same --nnodes and --nproc-per-node"),
                "{e}"
            );
            assert!(took < Duration::from_secs(10), "{took:?}: {e}");
        }
    }

    #[test]
    fn a_rank_that_ends_after_its_claim_is_named_at_once() {
        // Rank 1 claims its RANK as `meet` does, then its process ends
        // (the connection closes) before it publishes its host.
        let srv = StoreServer::serve("127.0.0.1:0", "tok").unwrap();
        let addr = srv.addr().to_string();
        let timeout = Duration::from_secs(30);
        let one = StoreClient::connect(&addr, "tok", timeout).unwrap();
        assert_eq!(one.add("claim/1", 1).unwrap(), 1);
        one.set_on_close(&gone_key(1)).unwrap();
        let zero = StoreClient::connect(&addr, "tok", timeout).unwrap();
        let t = Instant::now();
        let waiting = std::thread::spawn(move || meet(&zero, 0, 2, "h0", timeout));
        std::thread::sleep(Duration::from_millis(300));
        drop(one);
        let e = waiting.join().unwrap().unwrap_err().to_string();
        assert!(
            e.contains("rank 1 connected to the job and ended before it met the others"),
            "{e}"
        );
        assert!(t.elapsed() < Duration::from_secs(5), "{:?}", t.elapsed());
    }

    #[test]
    fn rank_0_says_whom_it_still_waits_for_until_they_come() {
        let srv = StoreServer::serve("127.0.0.1:0", "tok").unwrap();
        let addr = srv.addr().to_string();
        let timeout = Duration::from_secs(30);
        let client = || StoreClient::connect(&addr, "tok", timeout).unwrap();
        let (zero, one, two) = (client(), client(), client());
        let ms = Duration::from_millis;
        let said = std::thread::scope(|s| {
            let z = s.spawn(|| {
                let mut said = Vec::new();
                let waits = StillWaiting::every(ms(100), ms(100));
                let hosts = meet_saying(&zero, 0, 3, "h0", timeout, waits, |m| {
                    said.push((Instant::now(), m))
                });
                assert_eq!(hosts.unwrap(), ["h0", "h1", "h2"]);
                said
            });
            s.spawn(|| meet(&one, 1, 3, "h1", timeout).unwrap());
            std::thread::sleep(ms(450));
            meet(&two, 2, 3, "h2", timeout).unwrap();
            z.join().unwrap()
        });
        // One report a period, however often the wait looks.
        crate::still_waiting::assert_a_period_apart(&said, ms(100));
        for (_, m) in &said {
            assert!(
                m.starts_with("rendezvous: 2 of 3 ranks have joined after ")
                    && m.contains(" s, waiting for rank 2 (is every node's launcher running, with the same MASTER_ADDR:MASTER_PORT? the wait fails at 30 s, ZRT_TIMEOUT)"),
                "{m}"
            );
        }
    }

    #[test]
    fn a_long_list_of_missing_ranks_is_cut_short() {
        let srv = StoreServer::serve("127.0.0.1:0", "tok").unwrap();
        let c =
            StoreClient::connect(&srv.addr().to_string(), "tok", Duration::from_secs(5)).unwrap();
        let (waited, timeout) = (Duration::from_secs(40), Duration::from_secs(300));
        c.set("host/0", b"12 h").unwrap();
        c.set("host/5", b"12 h").unwrap();
        let said = still_waiting(&c, 1, 12, waited, timeout).unwrap().unwrap();
        assert!(
            said.starts_with("rendezvous: 2 of 12 ranks have joined after 40 s, waiting for ranks 1, 2, 3, 4, 6, 7, 8, 9 and 2 more ("),
            "{said}"
        );
        assert!(
            said.ends_with("the wait fails at 300 s, ZRT_TIMEOUT)"),
            "{said}"
        );
        // Eight are listed whole; two, too.
        let said = still_waiting(&c, 4, 13, waited, timeout).unwrap().unwrap();
        assert!(
            said.contains(" waiting for ranks 4, 6, 7, 8, 9, 10, 11, 12 ("),
            "{said}"
        );
        let said = still_waiting(&c, 3, 6, waited, timeout).unwrap().unwrap();
        assert!(said.contains(" waiting for ranks 3, 4 ("), "{said}");
        let said = still_waiting(&c, 4, 6, waited, timeout).unwrap().unwrap();
        assert!(
            said.contains("5 of 6 ranks have joined after 40 s, waiting for rank 4 ("),
            "{said}"
        );
        // All there since the wait looked: nothing to say.
        c.set("host/4", b"6 h").unwrap();
        assert_eq!(still_waiting(&c, 4, 6, waited, timeout).unwrap(), None);
    }

    #[test]
    fn a_rank_that_never_comes_is_named_at_the_timeout() {
        let out = meet_all(&[(0, 2)], Duration::from_millis(300));
        let (got, took) = &out[0];
        let e = got.clone().unwrap_err();
        assert!(e.contains("rank 1 did not join the job within 0 s"), "{e}");
        assert!(*took >= Duration::from_millis(300), "{took:?}");
    }
}

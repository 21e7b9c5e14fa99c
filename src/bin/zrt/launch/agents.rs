//! The launchers of a job on several nodes (`--nnodes` above 1), which
//! stop, restart and end it together: torchrun's elastic agents, reduced
//! to what a fixed set of nodes needs.
//!
//! Node 0's launcher serves a store of its own on `MASTER_PORT + 1`
//! (rank 0 serves the ranks' store on `MASTER_PORT`, afresh each attempt);
//! every launcher connects to it with the job's token. Each attempt is a
//! round: every launcher waits until all are ready (their previous ranks
//! stopped, so no rank of the new round can meet the old round's store),
//! starts its ranks, and while they run watches the round's failure
//! record. The first launcher whose ranks fail writes it; the others stop
//! their ranks on seeing it, and all of them start the next round or, with
//! no restarts left (or after a signal to a launcher, which ends the job),
//! exit with the failed rank's code. A launcher that ends early (it could
//! not start its ranks, or it died) is seen through its connection
//! closing, which the store counts at one key the others poll, and is
//! never waited for.

use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use zrt::collectives::store::{StoreClient, StoreServer};

use super::hosts::Remotes;

/// How often a waiting launcher looks at the store again.
const POLL: Duration = Duration::from_millis(50);

/// How long node 0's launcher keeps its store up at the end for the other
/// launchers to read the last round's outcome.
const LINGER: Duration = Duration::from_secs(10);

/// Why a round ended early, as every launcher reads it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Failure {
    /// The exit code the launchers end with if they do not restart.
    pub code: i32,
    /// A signal to a launcher: the job ends, no restart.
    pub stop: bool,
    /// What happened, naming the node and rank ("node 1's rank 3 exited
    /// with code 1").
    pub what: String,
}

impl Failure {
    fn encode(&self) -> Vec<u8> {
        format!("{}\t{}\t{}", self.code, u8::from(self.stop), self.what).into_bytes()
    }

    fn decode(b: &[u8]) -> Result<Self> {
        let s = String::from_utf8_lossy(b);
        let mut it = s.splitn(3, '\t');
        let (Some(code), Some(stop), Some(what)) = (it.next(), it.next(), it.next()) else {
            bail!("the launchers' store holds a malformed failure record `{s}`");
        };
        Ok(Self {
            code: code.parse().context("a failure record's code")?,
            stop: stop == "1",
            what: what.to_string(),
        })
    }
}

/// This launcher's place among the job's launchers.
pub(super) struct Agents {
    client: StoreClient,
    /// Node 0's: the store every launcher meets at.
    server: Option<StoreServer>,
    node: usize,
    nnodes: usize,
    timeout: Duration,
    /// The launchers of a hostfile's other nodes, which node 0's started.
    remotes: Option<Remotes>,
}

impl Agents {
    /// Meets the other nodes' launchers at `addr:port` (node 0 serves it),
    /// checking that they were given the same `settings` (the arguments
    /// every node must agree on, as text).
    pub(super) fn join(
        addr: &str,
        port: u16,
        token: &str,
        node: usize,
        nnodes: usize,
        settings: &str,
    ) -> Result<Self> {
        let timeout = zrt::collectives::default_timeout();
        let at = format!("{addr}:{port}");
        let server = match node {
            0 => Some(StoreServer::serve(&at, token).with_context(|| {
                format!("node 0's launcher serving the launchers' store on {at} (MASTER_PORT + 1)")
            })?),
            _ => None,
        };
        let client = StoreClient::connect(&at, token, timeout).with_context(|| {
            format!("joining the launchers' store on {at} (node 0's launcher serves it on MASTER_PORT + 1)")
        })?;
        // Claimed before the connection's end counts as this node's: a
        // second launcher given the same node rank leaves alone, without
        // making the first look gone, and the job goes on.
        if client.add(&format!("agent/node/{node}"), 1)? > 1 {
            bail!(
                "another launcher already runs node {node} of this job (--node-rank {node}): give each node's launcher its own, 0 to --nnodes - 1"
            );
        }
        client.set_on_close(&gone(node))?;
        client.count_on_close(GONE)?;
        let agents = Self {
            client,
            server,
            node,
            nnodes,
            timeout,
            remotes: None,
        };
        match node {
            0 => agents.client.set("agent/settings", settings.as_bytes())?,
            _ => {
                let theirs = agents.wait("node 0's settings", true, |c| {
                    Ok(c.get_within("agent/settings", Duration::ZERO)?)
                })?;
                let theirs = String::from_utf8_lossy(&theirs);
                if theirs != settings {
                    // Node 0 is told too, rather than waiting for a round
                    // that will not start.
                    let what = format!(
                        "node {node}'s launcher was given {settings}, node 0's {theirs}: give every node's launcher the same --nnodes, --nproc-per-node and --max-restarts"
                    );
                    agents.client.set("agent/refused", what.as_bytes())?;
                    bail!("{what}");
                }
            }
        }
        Ok(agents)
    }

    /// Watches `remotes` too: one whose ssh fails before its launcher
    /// joins ends every wait, naming it.
    pub(super) fn watch_remotes(&mut self, remotes: Remotes) {
        self.remotes = Some(remotes);
    }

    /// Fails naming a remote launcher that could not join (see
    /// [`Remotes::check`]).
    fn remotes_ok(&self) -> Result<()> {
        match &self.remotes {
            None => Ok(()),
            Some(r) => r.check(|k| {
                Ok(self
                    .client
                    .get_within(&format!("agent/node/{k}"), Duration::ZERO)?
                    .is_some())
            }),
        }
    }

    /// Waits until every launcher is ready for round `round` (its previous
    /// ranks gone).
    pub(super) fn ready(&self, round: u32) -> Result<()> {
        let key = format!("agent/ready/{round}");
        self.client.add(&key, 1)?;
        self.wait(
            &format!("every node's launcher to be ready for attempt {round}"),
            true,
            |c| Ok((c.add(&key, 0)? >= self.nnodes as i64).then_some(())),
        )
    }

    /// The failure record of round `round`, if a launcher wrote one.
    pub(super) fn failure(&self, round: u32) -> Result<Option<Failure>> {
        match self
            .client
            .get_within(&format!("agent/failed/{round}"), Duration::ZERO)?
        {
            Some(b) => Ok(Some(Failure::decode(&b)?)),
            None => Ok(None),
        }
    }

    /// What stops this node's ranks of round `round` early: the round's
    /// failure record, or a launcher that ended without writing one (the
    /// ranks on its node are gone with it, and the job cannot go on
    /// without them). Two requests, however many nodes.
    pub(super) fn watch(&self, round: u32) -> Result<Option<Failure>> {
        if let Some(f) = self.failure(round)? {
            return Ok(Some(f));
        }
        self.remotes_ok()?;
        if self.client.add(GONE, 0)? == 0 {
            return Ok(None);
        }
        // Read again: a launcher that wrote the record and then left (its
        // job over, with no restarts left) is not the cause.
        if let Some(f) = self.failure(round)? {
            return Ok(Some(f));
        }
        Ok(Some(Failure {
            code: 1,
            stop: true,
            what: format!(
                "{} ended (it exited, was stopped or died) while the ranks of attempt {round} ran: every node's launcher runs until the job ends; its own output says why",
                self.gone_one()?
            ),
        }))
    }

    /// Names a launcher whose connection ended ("node 2's launcher"), once
    /// the count of them is above 0.
    fn gone_one(&self) -> Result<String> {
        for k in (0..self.nnodes).filter(|&k| k != self.node) {
            if self.client.get_within(&gone(k), Duration::ZERO)?.is_some() {
                return Ok(format!("node {k}'s launcher"));
            }
        }
        Ok("another node's launcher".to_string())
    }

    /// Reports this node's failure in round `round`; returns the round's
    /// record, which is another node's when that one was first.
    pub(super) fn report(&self, round: u32, f: Failure) -> Result<Failure> {
        if self.client.add(&format!("agent/failures/{round}"), 1)? == 1 {
            self.client
                .set(&format!("agent/failed/{round}"), &f.encode())?;
            return Ok(f);
        }
        self.wait("the first failure's record", true, |c| {
            Ok(c.get_within(&format!("agent/failed/{round}"), Duration::ZERO)?)
        })
        .and_then(|b| Failure::decode(&b))
    }

    /// Once this node's ranks of round `round` all ended well: waits for
    /// the other nodes' to, `None`, or for the round's failure record. No
    /// timeout: their ranks may train for hours yet (a rank 0 that
    /// evaluates and exports alone at the end); a launcher that ends
    /// without saying so is seen by its connection closing.
    pub(super) fn finish(&self, round: u32) -> Result<Option<Failure>> {
        let key = format!("agent/done/{round}");
        self.client.add(&key, 1)?;
        self.wait(
            &format!("the other nodes' ranks of attempt {round} to end"),
            false,
            |c| {
                if c.add(&key, 0)? >= self.nnodes as i64 {
                    return Ok(Some(None));
                }
                Ok(self.failure(round)?.map(Some))
            },
        )
    }

    /// The end of this launcher's part. Node 0 keeps its store up until
    /// the others have left (at most [`LINGER`]), so that each reads the
    /// last round's outcome.
    pub(super) fn leave(mut self) {
        if self.server.is_none() {
            return;
        }
        let remotes = self.remotes.take();
        let t0 = Instant::now();
        while t0.elapsed() < LINGER {
            let left = self
                .client
                .add(GONE, 0)
                .map_or(true, |n| n >= self.nnodes as i64 - 1);
            if left {
                break;
            }
            std::thread::sleep(POLL);
        }
        if let Some(r) = remotes {
            r.finish(LINGER);
        }
    }

    /// Polls `done` until it gives a value; fails when another launcher
    /// ends, a launcher refused the job, this launcher gets a signal, or,
    /// if `timed`, the timeout passes.
    fn wait<T>(
        &self,
        what: &str,
        timed: bool,
        mut done: impl FnMut(&StoreClient) -> Result<Option<T>>,
    ) -> Result<T> {
        let deadline = zrt::collectives::deadline_in(self.timeout);
        loop {
            if let Some(v) = done(&self.client)? {
                return Ok(v);
            }
            self.remotes_ok()?;
            if let Some(why) = self.client.get_within("agent/refused", Duration::ZERO)? {
                bail!("{}", String::from_utf8_lossy(&why));
            }
            if self.client.add(GONE, 0)? > 0 {
                bail!(
                    "{} ended (it exited, was stopped or died) while this one waited for {what}: every node's launcher runs until the job ends; its own output says why",
                    self.gone_one()?
                );
            }
            if super::signalled() {
                bail!("got a signal while waiting for {what}");
            }
            if timed && Instant::now() >= deadline {
                bail!(
                    "waited {:.0} s for {what} (ZRT_TIMEOUT): is every node's launcher running, with the same --master-addr and --master-port?",
                    self.timeout.as_secs_f64()
                );
            }
            std::thread::sleep(POLL);
        }
    }
}

/// The count of launchers whose connection closed.
const GONE: &str = "agent/gone_count";

/// The key node `k`'s launcher's connection sets when it closes.
fn gone(k: usize) -> String {
    format!("agent/gone/{k}")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn failure_records_read_back_as_written() {
        let f = Failure {
            code: 137,
            stop: false,
            what: "node 1's rank 3 was killed by signal 9\twith a tab".into(),
        };
        assert_eq!(Failure::decode(&f.encode()).unwrap(), f);
        let s = Failure {
            code: 130,
            stop: true,
            what: "node 0's launcher got signal 2".into(),
        };
        assert_eq!(Failure::decode(&s.encode()).unwrap(), s);
        assert!(Failure::decode(b"nonsense").is_err());
    }
}

//! The launchers of a job on several nodes (`--nnodes` above 1), which
//! stop, restart and end it together: torchrun's elastic agents.
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
//!
//! An elastic job (`--nnodes MIN:MAX`) has no fixed set: node 0's
//! launcher closes each round once MAX launchers have joined it, or
//! `--last-call` after MIN had, and places them (itself first, the rest
//! in the order they joined); a launcher that comes later waits for the
//! next round, and the members, seeing it wait, all restart with it (not
//! counted against `--max-restarts`, as under torchrun); a member that
//! ends early fails the round, and the others restart without it while
//! at least MIN remain. Every round's outcome is one record all members
//! read, and the restarts used one count in the store, so the launchers
//! agree on both however many rounds each of them saw.

use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use zrt::collectives::store::{StoreClient, StoreServer};

use super::hosts::Remotes;

/// How often a waiting launcher looks at the store again.
const POLL: Duration = Duration::from_millis(50);

/// How long node 0 waits for a launcher that counted itself into an
/// elastic round to give its name.
const NAMED_WITHIN: Duration = Duration::from_secs(5);

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
    /// A launcher waits to join an elastic job: every node restarts with
    /// it, no restart counted.
    pub rejoin: bool,
    /// What happened, naming the node and rank ("node 1's rank 3 exited
    /// with code 1").
    pub what: String,
}

impl Failure {
    /// A failure that ends the job or restarts it (`stop`), counted.
    pub(super) fn new(code: i32, stop: bool, what: String) -> Self {
        Self {
            code,
            stop,
            rejoin: false,
            what,
        }
    }

    fn encode(&self) -> Vec<u8> {
        let flags = u8::from(self.stop) | (u8::from(self.rejoin) << 1);
        format!("{}\t{flags}\t{}", self.code, self.what).into_bytes()
    }

    fn decode(b: &[u8]) -> Result<Self> {
        let s = String::from_utf8_lossy(b);
        let mut it = s.splitn(3, '\t');
        let (Some(code), Some(flags), Some(what)) = (it.next(), it.next(), it.next()) else {
            bail!("the launchers' store holds a malformed failure record `{s}`");
        };
        let flags: u8 = flags.parse().context("a failure record's flags")?;
        Ok(Self {
            code: code.parse().context("a failure record's code")?,
            stop: flags & 1 != 0,
            rejoin: flags & 2 != 0,
            what: what.to_string(),
        })
    }
}

/// An elastic job's bounds (`--nnodes MIN:MAX`, `--last-call`).
#[derive(Debug, Clone, Copy)]
pub(super) struct Elastic {
    pub min: usize,
    pub max: usize,
    /// How long node 0 waits for more launchers once MIN have joined.
    pub last_call: Duration,
}

/// Where this launcher's node is in one round: what its ranks are told.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Place {
    /// The round (attempt) number: `--log-dir`'s `attempt_N`.
    pub round: u32,
    /// This node's index in the round (GROUP_RANK).
    pub node: usize,
    /// The round's nodes (GROUP_WORLD_SIZE).
    pub nnodes: usize,
    /// Restarts used before it (TORCHELASTIC_RESTART_COUNT).
    pub restarts: u32,
}

/// This launcher's place among the job's launchers.
pub(super) struct Agents {
    client: StoreClient,
    /// Node 0's: the store every launcher meets at.
    server: Option<StoreServer>,
    /// This launcher's `--node-rank`: its name in the store and in
    /// messages (in an elastic job, not its place in a round).
    node: usize,
    /// A fixed job's nodes; an elastic job's MAX.
    nnodes: usize,
    elastic: Option<Elastic>,
    timeout: Duration,
    /// The launchers of a hostfile's other nodes, which node 0's started.
    remotes: Option<Remotes>,
    /// The current round's members, by `--node-rank`, in place order.
    members: Vec<usize>,
    /// Launchers gone that were no member of the current round (an
    /// elastic job's): not this round's failure.
    gone_seen: std::cell::Cell<i64>,
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
        elastic: Option<Elastic>,
        settings: &str,
    ) -> Result<Self> {
        let timeout = zrt::collectives::default_timeout();
        let at = format!("{addr}:{port}");
        let server = match node {
            0 => Some(StoreServer::serve(&at, token).with_context(|| {
                let hint = match elastic {
                    // Every launcher of an elastic job left at the default
                    // --node-rank 0 tries to serve.
                    Some(_) => "; in an elastic job give --node-rank 0 to the launcher at MASTER_ADDR only, and each other one a number of its own",
                    None => "",
                };
                format!("node 0's launcher serving the launchers' store on {at} (MASTER_PORT + 1){hint}")
            })?),
            _ => None,
        };
        let client = StoreClient::connect(&at, token, timeout).with_context(|| {
            format!("joining the launchers' store on {at} (node 0's launcher serves it on MASTER_PORT + 1)")
        })?;
        // Claimed before the connection's end counts as this node's: a
        // second launcher given the same node rank leaves alone, without
        // making the first look gone, and the job goes on.
        if client.add(&format!("agent/node/{node}"), 1)? > 1
            // An elastic job takes a node back once its launcher is gone
            // (a preempted node's replacement).
            && !(elastic.is_some()
                && node != 0
                && client.get_within(&gone(node), Duration::ZERO)?.is_some())
        {
            bail!(
                "another launcher already runs node {node} of this job (--node-rank {node}): give each node's launcher its own, 0 to --nnodes - 1"
            );
        }
        client.delete(&gone(node))?;
        client.set_on_close(&gone(node))?;
        client.count_on_close(GONE)?;
        client.add(JOINED, 1)?;
        let agents = Self {
            client,
            server,
            node,
            nnodes,
            elastic,
            timeout,
            remotes: None,
            members: Vec::new(),
            gone_seen: std::cell::Cell::new(0),
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
    /// ranks gone); returns this node's place in it. An elastic job's
    /// launcher may be placed in a later round (this one was full), or
    /// told the job is over.
    pub(super) fn ready(&mut self, round: u32) -> Result<Option<Place>> {
        let Some(el) = self.elastic else {
            let restarts = self.restarts_used()?;
            let key = format!("agent/ready/{round}");
            self.client.add(&key, 1)?;
            self.wait(
                &format!("every node's launcher to be ready for attempt {round}"),
                true,
                |c| Ok((c.add(&key, 0)? >= self.nnodes as i64).then_some(())),
            )?;
            self.members = (0..self.nnodes).collect();
            return Ok(Some(Place {
                round,
                node: self.node,
                nnodes: self.nnodes,
                restarts,
            }));
        };
        // A launcher that comes late joins the round after the one node 0
        // last closed: the launchers running that one see it wait.
        let mut round = match self.client.get_within(CURRENT, Duration::ZERO)? {
            Some(b) => {
                let next = String::from_utf8_lossy(&b)
                    .parse::<u32>()
                    .map_or(0, |r| r + 1);
                if next > round {
                    eprintln!(
                        "zrt launch: the job runs attempt {}; this node waits to join attempt {next} (the running nodes restart with it while they are fewer than {})",
                        next - 1,
                        el.max
                    );
                }
                round.max(next)
            }
            None => round,
        };
        loop {
            let Some(members) = self.join_round(round, el)? else {
                return Ok(None);
            };
            if let Some(node) = members.iter().position(|&m| m == self.node) {
                self.gone_seen.set(self.client.add(GONE, 0)?);
                let nnodes = members.len();
                self.members = members;
                return Ok(Some(Place {
                    round,
                    node,
                    nnodes,
                    restarts: self.restarts_used()?,
                }));
            }
            eprintln!(
                "zrt launch: attempt {round} started with {} node(s) without this one; waiting to join the next",
                members.len()
            );
            round += 1;
        }
    }

    /// Joins elastic round `round`; its members once node 0 closed it
    /// (`None`: the job ended first).
    fn join_round(&self, round: u32, el: Elastic) -> Result<Option<Vec<usize>>> {
        let count = format!("agent/round/{round}/count");
        let k = self.client.add(&count, 1)?;
        self.client.set(
            &format!("agent/round/{round}/member/{k}"),
            self.node.to_string().as_bytes(),
        )?;
        let key = format!("agent/round/{round}/members");
        if self.server.is_some() {
            let mut min_since: Option<Instant> = None;
            let n = self.wait(
                &format!(
                    "at least {} node(s)' launchers to join attempt {round}",
                    el.min
                ),
                true,
                |c| {
                    let n = c.add(&count, 0)? as usize;
                    if n >= el.min && min_since.is_none() {
                        min_since = Some(Instant::now());
                    }
                    let called = min_since.is_some_and(|t| t.elapsed() >= el.last_call);
                    Ok((n >= el.max || called).then_some(n.min(el.max)))
                },
            )?;
            let mut members = vec![self.node];
            for j in 1..=n {
                // Each launcher names itself right after counting itself
                // in; one that died in between is left out.
                let key = format!("agent/round/{round}/member/{j}");
                let Some(b) = self.client.get_within(&key, NAMED_WITHIN)? else {
                    continue;
                };
                let m: usize = String::from_utf8_lossy(&b)
                    .parse()
                    .context("a joining launcher's name")?;
                if m != self.node && members.len() < el.max {
                    members.push(m);
                }
            }
            let text: Vec<String> = members.iter().map(|m| m.to_string()).collect();
            self.client.set(&key, text.join(",").as_bytes())?;
            self.client.set(CURRENT, round.to_string().as_bytes())?;
            return Ok(Some(members));
        }
        let text = self.wait(
            &format!("node 0's launcher to start attempt {round}"),
            false,
            |c| {
                if c.get_within(OVER, Duration::ZERO)?.is_some() {
                    return Ok(Some(None));
                }
                Ok(c.get_within(&key, Duration::ZERO)?.map(Some))
            },
        )?;
        let Some(text) = text else {
            return Ok(None);
        };
        String::from_utf8_lossy(&text)
            .split(',')
            .map(|m| m.parse().context("a round's members"))
            .collect::<Result<Vec<usize>>>()
            .map(Some)
    }

    /// The restarts the job has used: failures recorded, not counting
    /// rounds started for a launcher joining.
    pub(super) fn restarts_used(&self) -> Result<u32> {
        Ok(self.client.add(RESTARTS, 0)?.try_into().unwrap_or(0))
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
    /// failure record; in an elastic job with room, a launcher waiting to
    /// join; or a launcher of the round that ended without writing a
    /// record (the ranks on its node are gone with it: a fixed job ends,
    /// an elastic one restarts without it). Two requests while nothing
    /// happens (three in an elastic job, four while a launcher waits),
    /// however many nodes.
    pub(super) fn watch(&self, round: u32) -> Result<Option<Failure>> {
        if let Some(f) = self.failure(round)? {
            return Ok(Some(f));
        }
        self.remotes_ok()?;
        // A launcher waiting while the round has room for it (one beyond
        // MAX is a spare, taken when a member goes), unless a node's ranks
        // of the round already ended well: the job is ending, and
        // restarting would run those ranks again (the waiter is told when
        // it ends, as a spare is). Until 2026-12-01 it restarted them.
        if self.elastic.is_some_and(|el| self.members.len() < el.max)
            && self
                .client
                .add(&format!("agent/round/{}/count", round + 1), 0)?
                > 0
            && self.client.add(&format!("agent/done/{round}"), 0)? == 0
        {
            let f = Failure {
                code: 0,
                stop: false,
                rejoin: true,
                what: "a node's launcher waits to join the job".to_string(),
            };
            return self.report(round, f).map(Some);
        }
        let Some(who) = self.lost()? else {
            return Ok(None);
        };
        // Read again: a launcher that wrote the record and then left (its
        // job over, with no restarts left) is not the cause.
        if let Some(f) = self.failure(round)? {
            return Ok(Some(f));
        }
        // A fixed job cannot go on without the node; an elastic one
        // restarts without it.
        let then = match self.elastic {
            None => {
                "every node's launcher runs until the job ends; its own output says why".to_string()
            }
            Some(el) => format!(
                "the others go on without it while at least {} node(s) remain",
                el.min
            ),
        };
        let f = Failure::new(
            1,
            self.elastic.is_none(),
            format!("{who} ended (it exited, was stopped or died) while the ranks of attempt {round} ran: {then}"),
        );
        self.report(round, f).map(Some)
    }

    /// A launcher of this round whose connection ended ("node 2's
    /// launcher"), if any: in a fixed job any other launcher; in an
    /// elastic one a member of the round (a launcher that waited and went
    /// is no failure). One request while none has ended.
    fn lost(&self) -> Result<Option<String>> {
        let n = self.client.add(GONE, 0)?;
        if n <= self.gone_seen.get() {
            return Ok(None);
        }
        let candidates: Vec<usize> = match self.elastic {
            None => (0..self.nnodes).collect(),
            Some(_) => self.members.clone(),
        };
        for k in candidates.into_iter().filter(|&k| k != self.node) {
            if self.client.get_within(&gone(k), Duration::ZERO)?.is_some() {
                return Ok(Some(format!("node {k}'s launcher")));
            }
        }
        if self.elastic.is_some() {
            self.gone_seen.set(n);
            return Ok(None);
        }
        Ok(Some("another node's launcher".to_string()))
    }

    /// Reports this node's failure in round `round`; returns the round's
    /// record, which is another node's when that one was first.
    pub(super) fn report(&self, round: u32, f: Failure) -> Result<Failure> {
        if self.client.add(&format!("agent/failures/{round}"), 1)? == 1 {
            // Counted before the record is written: whoever reads the
            // record reads the count with it.
            if !f.stop && !f.rejoin {
                self.client.add(RESTARTS, 1)?;
            }
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
        let f = self.wait(
            &format!("the other nodes' ranks of attempt {round} to end"),
            false,
            |c| {
                if c.add(&key, 0)? >= self.members.len() as i64 {
                    return Ok(Some(None));
                }
                if let Some(f) = self.failure(round)? {
                    return Ok(Some(Some(f)));
                }
                // A fixed job's `wait` names a lost launcher itself, and
                // ends the job.
                if self.elastic.is_none() {
                    return Ok(None);
                }
                let Some(who) = self.lost()? else {
                    return Ok(None);
                };
                // A launcher counts itself done before it leaves: one that
                // left since the count above was read may have.
                if c.add(&key, 0)? >= self.members.len() as i64 {
                    return Ok(Some(None));
                }
                Ok(Some(Some(Failure::new(
                    1,
                    false,
                    format!("{who} ended (it exited, was stopped or died) before its ranks of attempt {round} did"),
                ))))
            },
        )?;
        // The round's record: this one if it is the first.
        f.map(|f| self.report(round, f)).transpose()
    }

    /// The end of this launcher's part. Node 0 keeps its store up until
    /// the others have left (at most [`LINGER`]), so that each reads the
    /// last round's outcome.
    pub(super) fn leave(mut self) {
        if self.server.is_none() {
            return;
        }
        let remotes = self.remotes.take();
        // Launchers still waiting to join an elastic job end too.
        let _ = self.client.set(OVER, b"1");
        let t0 = Instant::now();
        while t0.elapsed() < LINGER {
            let joined = self.client.add(JOINED, 0).unwrap_or(0);
            let left = self.client.add(GONE, 0).map_or(true, |n| n >= joined - 1);
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
            if self.elastic.is_none() {
                if let Some(who) = self.lost()? {
                    // What it waited for may have come just before the
                    // launcher left (one that finished its part counts
                    // itself done, then ends): until stop 76 a job whose
                    // other node finished between the two reads failed.
                    if let Some(v) = done(&self.client)? {
                        return Ok(v);
                    }
                    bail!(
                        "{who} ended (it exited, was stopped or died) while this one waited for {what}: every node's launcher runs until the job ends; its own output says why"
                    );
                }
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

/// The count of launchers that joined the job.
const JOINED: &str = "agent/joined";

/// The restarts the job has used (failures, not launchers joining).
const RESTARTS: &str = "agent/restarts";

/// The elastic round node 0 last closed.
const CURRENT: &str = "agent/current";

/// Set once node 0's launcher is done with the job.
const OVER: &str = "agent/over";

/// The key node `k`'s launcher's connection sets when it closes.
fn gone(k: usize) -> String {
    format!("agent/gone/{k}")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn failure_records_read_back_as_written() {
        let f = Failure::new(
            137,
            false,
            "node 1's rank 3 was killed by signal 9\twith a tab".into(),
        );
        assert_eq!(Failure::decode(&f.encode()).unwrap(), f);
        let s = Failure::new(130, true, "node 0's launcher got signal 2".into());
        assert_eq!(Failure::decode(&s.encode()).unwrap(), s);
        let r = Failure {
            code: 0,
            stop: false,
            rejoin: true,
            what: "a node's launcher waits".into(),
        };
        assert_eq!(Failure::decode(&r.encode()).unwrap(), r);
        assert!(Failure::decode(b"nonsense").is_err());
    }
}

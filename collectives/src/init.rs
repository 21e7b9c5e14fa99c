//! Joining a job from the environment `zrt launch` (or torchrun) sets.

use std::sync::Arc;
use std::time::Duration;

use crate::local::LocalGroup;
use crate::rendezvous;
use crate::shm::{slot_bytes_from_env, ShmGroup, ShmJoin, SlotStores};
use crate::store::{StoreClient, StoreServer, MAX_TOKEN_LEN};
use crate::tcp::{window_bytes_from_env, TcpGroup, TcpJoin};
use crate::work::timeout_from_env;
use crate::{CommError, DeviceMesh, Element, ProcessGroup, ReduceOp, Stats, SymmetricBuf, Work};

/// The environment contract of `zrt launch`, as torchrun's.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DistEnv {
    /// `RANK`: this process's rank in the world.
    pub rank: usize,
    /// `WORLD_SIZE`: ranks in the world.
    pub world_size: usize,
    /// `LOCAL_RANK`: rank on this host.
    pub local_rank: usize,
    /// `LOCAL_WORLD_SIZE`: ranks on this host.
    pub local_world_size: usize,
    /// `MASTER_ADDR`: where rank 0 serves the rendezvous store.
    pub master_addr: String,
    /// `MASTER_PORT`: its port.
    pub master_port: u16,
    /// `ZRT_TOKEN`: the job's secret; the store admits only peers presenting it.
    pub token: String,
}

fn var(name: &str) -> Result<String, CommError> {
    std::env::var(name).map_err(|_| {
        CommError::Rendezvous(format!(
            "{name} is not set: start ranks with `zrt launch --nproc-per-node N -- PROGRAM`, or set RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT and ZRT_TOKEN as it does"
        ))
    })
}

/// `ZRT_TOKEN`, which must be set and not blank: the store admits whoever
/// presents it, so an empty one would admit any process.
fn token(v: Option<String>) -> Result<String, CommError> {
    let fix = "`zrt launch` makes one; when torchrun, srun or mpirun starts the ranks, export the same secret to every rank first (e.g. `export ZRT_TOKEN=$(openssl rand -hex 16)`)";
    match v {
        None => Err(CommError::Rendezvous(format!(
            "ZRT_TOKEN is not set: {fix}"
        ))),
        Some(t) if t.trim().is_empty() => Err(CommError::Rendezvous(format!(
            "ZRT_TOKEN is empty, which would admit any process to the job's store: {fix}"
        ))),
        Some(t) if t.len() > MAX_TOKEN_LEN => Err(CommError::Rendezvous(format!(
            "ZRT_TOKEN is {} bytes; the store accepts at most {MAX_TOKEN_LEN}: use a shorter secret ({fix})",
            t.len()
        ))),
        Some(t) => Ok(t),
    }
}

fn num<T: std::str::FromStr>(name: &str) -> Result<T, CommError> {
    let v = var(name)?;
    v.trim()
        .parse()
        .map_err(|_| CommError::Rendezvous(format!("{name}={v:?} is not a number")))
}

impl DistEnv {
    /// Reads the contract, naming the first variable that is missing or bad.
    pub fn from_env() -> Result<Self, CommError> {
        let e = Self {
            rank: num("RANK")?,
            world_size: num("WORLD_SIZE")?,
            local_rank: num("LOCAL_RANK")?,
            local_world_size: num("LOCAL_WORLD_SIZE")?,
            master_addr: var("MASTER_ADDR")?,
            master_port: num("MASTER_PORT")?,
            token: token(std::env::var("ZRT_TOKEN").ok())?,
        };
        e.check()?;
        Ok(e)
    }

    /// Refuses a contract no job could run with, before anything waits on
    /// it: a mistake here would otherwise surface as a rendezvous that
    /// times out.
    fn check(&self) -> Result<(), CommError> {
        let bad = |what: String| Err(CommError::Rendezvous(what));
        if self.rank >= self.world_size {
            return bad(format!(
                "RANK={} is not below WORLD_SIZE={}",
                self.rank, self.world_size
            ));
        }
        if self.local_rank >= self.local_world_size {
            return bad(format!(
                "LOCAL_RANK={} is not below LOCAL_WORLD_SIZE={}",
                self.local_rank, self.local_world_size
            ));
        }
        if self.local_world_size > self.world_size {
            return bad(format!(
                "LOCAL_WORLD_SIZE={} is more than WORLD_SIZE={}: a host cannot run more ranks than the job has",
                self.local_world_size, self.world_size
            ));
        }
        // Rank 0's store would listen on a port the kernel picks, which the
        // other ranks cannot know: they would wait out the timeout.
        if self.master_port == 0 {
            return bad("MASTER_PORT=0 names no port the ranks could meet on: give every rank the same port, 1 to 65535".into());
        }
        Ok(())
    }

    /// A name for this job's files that does not reveal the token.
    pub fn job_id(&self) -> String {
        // FNV-1a over token and port: unique per job, not invertible to the token in practice.
        let mut h: u64 = 0xcbf2_9ce4_8422_2325;
        for b in self.token.bytes().chain(self.master_port.to_le_bytes()) {
            h = (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3);
        }
        format!("{h:016x}")
    }
}

/// Which transport a job's groups use.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Backend {
    /// Shared memory: processes on one host.
    Shm,
    /// TCP: processes on any hosts.
    Tcp,
}

/// A group of any backend (the trait has generic methods, so it is not a
/// trait object; this enum is how code holds "some group").
pub enum Group {
    /// Ranks as threads.
    Local(LocalGroup),
    /// Processes on one host.
    Shm(ShmGroup),
    /// Processes on any hosts.
    Tcp(TcpGroup),
}

macro_rules! each {
    ($self:expr, $g:ident => $e:expr) => {
        match $self {
            Group::Local($g) => $e,
            Group::Shm($g) => $e,
            Group::Tcp($g) => $e,
        }
    };
}

impl ProcessGroup for Group {
    fn name(&self) -> &str {
        each!(self, g => g.name())
    }
    fn rank(&self) -> usize {
        each!(self, g => g.rank())
    }
    fn size(&self) -> usize {
        each!(self, g => g.size())
    }
    fn world_ranks(&self) -> &[usize] {
        each!(self, g => g.world_ranks())
    }
    fn stats(&self) -> &Stats {
        each!(self, g => g.stats())
    }
    fn all_reduce<T: Element>(&self, buf: Vec<T>, op: ReduceOp) -> Work<Vec<T>> {
        each!(self, g => g.all_reduce(buf, op))
    }
    fn reduce_scatter<T: Element>(
        &self,
        input: Vec<T>,
        out: Vec<T>,
        op: ReduceOp,
    ) -> Work<(Vec<T>, Vec<T>)> {
        each!(self, g => g.reduce_scatter(input, out, op))
    }
    fn all_gather<T: Element>(&self, input: Vec<T>, out: Vec<T>) -> Work<(Vec<T>, Vec<T>)> {
        each!(self, g => g.all_gather(input, out))
    }
    fn all_gather_v<T: Element>(&self, input: Vec<T>, out: Vec<T>) -> Work<(Vec<T>, Vec<T>)> {
        each!(self, g => g.all_gather_v(input, out))
    }
    fn all_gather_in_place<T: Element>(&self, buf: Vec<T>) -> Work<Vec<T>> {
        each!(self, g => g.all_gather_in_place(buf))
    }
    fn all_to_all<T: Element>(&self, input: Vec<T>, out: Vec<T>) -> Work<(Vec<T>, Vec<T>)> {
        each!(self, g => g.all_to_all(input, out))
    }
    fn reduce_scatter_in_place<T: Element>(&self, buf: Vec<T>, op: ReduceOp) -> Work<Vec<T>> {
        each!(self, g => g.reduce_scatter_in_place(buf, op))
    }
    fn alloc_symmetric<T: Element>(&self, len: usize) -> Work<SymmetricBuf<T>> {
        each!(self, g => g.alloc_symmetric(len))
    }
    fn reduce_scatter_symmetric<T: Element>(
        &self,
        buf: SymmetricBuf<T>,
        op: ReduceOp,
    ) -> Work<SymmetricBuf<T>> {
        each!(self, g => g.reduce_scatter_symmetric(buf, op))
    }
    fn all_gather_symmetric<T: Element>(&self, buf: SymmetricBuf<T>) -> Work<SymmetricBuf<T>> {
        each!(self, g => g.all_gather_symmetric(buf))
    }
    fn broadcast<T: Element>(&self, buf: Vec<T>, root: usize) -> Work<Vec<T>> {
        each!(self, g => g.broadcast(buf, root))
    }
    fn barrier(&self) -> Work<()> {
        each!(self, g => g.barrier())
    }
    fn send<T: Element>(&self, buf: Vec<T>, to: usize) -> Work<()> {
        each!(self, g => g.send(buf, to))
    }
    fn recv<T: Element>(&self, len: usize, from: usize) -> Work<Vec<T>> {
        each!(self, g => g.recv(len, from))
    }
}

/// This process's membership in a job: the world group, and the way to make
/// sub-groups and meshes.
pub struct Dist {
    env: DistEnv,
    backend: Backend,
    store: Arc<StoreClient>,
    world: Group,
    created: std::collections::HashMap<Vec<usize>, u32>,
    timeout: Duration,
    settings: Settings,
    // Last: the server must outlive this rank's own client and groups.
    _server: Option<StoreServer>,
}

/// Joins the job this process was started in: reads the environment
/// contract ([`DistEnv`]), serves the rendezvous store on rank 0, connects
/// to it, and joins the world group.
///
/// The backend is shm when every rank runs on this host and tcp otherwise;
/// `ZRT_BACKEND=shm|tcp` overrides that (shm across hosts is refused).
/// `ZRT_TIMEOUT` (seconds) bounds every wait, `ZRT_SHM_SLOT_BYTES` sizes
/// the shm staging slots and `ZRT_SHM_SLOT_STORES` (`auto`, `plain`,
/// `streaming`) says how they are written, `ZRT_TCP_WINDOW_BYTES` sizes
/// the tcp backend's reduction windows. A variable that is missing or
/// malformed is an error naming it, raised before any connection so that
/// every rank fails on its own configuration.
pub fn init_from_env() -> Result<Dist, CommError> {
    let env = DistEnv::from_env()?;
    // Checked before any connection, so every rank fails on its own config
    // rather than on a peer that already gave up.
    let requested = match std::env::var("ZRT_BACKEND").ok().as_deref() {
        None | Some("") => None,
        Some("shm") => Some(Backend::Shm),
        Some("tcp") => Some(Backend::Tcp),
        Some(other) => {
            return Err(CommError::Rendezvous(format!(
                "ZRT_BACKEND={other:?} is not a backend: use shm (one host) or tcp (any hosts){}",
                if other == "nccl" {
                    "; nccl needs a build with the `cuda` feature and GPUs"
                } else {
                    ""
                }
            )))
        }
    };
    let timeout = timeout_from_env().map_err(CommError::Rendezvous)?;
    let settings = Settings {
        slot_bytes: slot_bytes_from_env().map_err(CommError::Rendezvous)?,
        slot_stores: SlotStores::from_env().map_err(CommError::Rendezvous)?,
        tcp_window_bytes: window_bytes_from_env().map_err(CommError::Rendezvous)?,
    };
    let addr = format!("{}:{}", env.master_addr, env.master_port);
    let server = if env.rank == 0 {
        Some(StoreServer::serve(&addr, &env.token)?)
    } else {
        None
    };
    let store = Arc::new(StoreClient::connect(&addr, &env.token, timeout)?);
    let hosts = rendezvous::meet(&store, env.rank, env.world_size, &hostname(), timeout)?;
    let backend = choose_backend(requested, hosts.iter().all(|h| h == &hosts[0]))?;
    let all: Vec<usize> = (0..env.world_size).collect();
    let world = join_group(&env, backend, &store, settings, timeout, "world", &all)?;
    tracing::info!(
        rank = env.rank,
        world = env.world_size,
        ?backend,
        "joined the job"
    );
    Ok(Dist {
        env,
        backend,
        store,
        world,
        created: Default::default(),
        timeout,
        settings,
        _server: server,
    })
}

/// The backend for a job: `requested` (`ZRT_BACKEND`) if set, else shm when
/// every rank runs on one host and tcp otherwise; shm across hosts is an
/// error.
fn choose_backend(requested: Option<Backend>, same_host: bool) -> Result<Backend, CommError> {
    match requested {
        None if same_host => Ok(Backend::Shm),
        None => Ok(Backend::Tcp),
        Some(Backend::Shm) if !same_host => Err(CommError::Rendezvous(
            "ZRT_BACKEND=shm, but the ranks run on several hosts: use tcp (or leave ZRT_BACKEND unset)".into(),
        )),
        Some(b) => Ok(b),
    }
}

/// The backends' settings from the environment, for every group.
#[derive(Clone, Copy)]
struct Settings {
    slot_bytes: usize,
    slot_stores: SlotStores,
    tcp_window_bytes: usize,
}

/// Joins (creates, for the first member) the group `name` of `ranks`.
fn join_group(
    env: &DistEnv,
    backend: Backend,
    store: &Arc<StoreClient>,
    settings: Settings,
    timeout: Duration,
    name: &str,
    ranks: &[usize],
) -> Result<Group, CommError> {
    Ok(match backend {
        Backend::Shm => Group::Shm(ShmGroup::join(ShmJoin {
            store: store.clone(),
            job: &env.job_id(),
            name,
            world_ranks: ranks.to_vec(),
            world_rank: env.rank,
            slot_bytes: settings.slot_bytes,
            slot_stores: settings.slot_stores,
            timeout,
        })?),
        Backend::Tcp => Group::Tcp(TcpGroup::join(TcpJoin {
            store: store.clone(),
            token: &env.token,
            name,
            world_ranks: ranks.to_vec(),
            world_rank: env.rank,
            timeout,
            window_bytes: settings.tcp_window_bytes,
        })?),
    })
}

fn hostname() -> String {
    // The boot id tells containers on one kernel apart from hosts sharing a name.
    let name = std::fs::read_to_string("/proc/sys/kernel/hostname").unwrap_or_default();
    let boot = std::fs::read_to_string("/proc/sys/kernel/random/boot_id").unwrap_or_default();
    format!("{}/{}", name.trim(), boot.trim())
}

impl Drop for Dist {
    /// Leaves the world group, then checks out through the store. Rank 0
    /// serves the store, so it keeps serving until every rank has checked
    /// out (or left, or died), at most the timeout: a rank that finishes
    /// first must not take the store away from peers still using it.
    ///
    /// Leaving comes first so that peers still waiting for this rank in a
    /// collective (it returned early, on an error or out of data) fail at
    /// once naming it, check out in turn, and let rank 0 stop waiting.
    /// Groups made with [`Dist::new_group`] or [`Dist::mesh`] are the
    /// caller's: drop them before the `Dist` (declared after it, they are).
    fn drop(&mut self) {
        match &mut self.world {
            Group::Shm(g) => g.close(),
            Group::Tcp(g) => g.close(),
            Group::Local(_) => {}
        }
        let n = self.env.world_size as i64;
        if let Ok(k) = self.store.add("finalized", 1) {
            if k == n {
                let _ = self.store.set("all-finalized", &[]);
            }
        }
        if self.env.rank != 0 {
            return;
        }
        let deadline = crate::work::deadline_in(self.timeout);
        while std::time::Instant::now() < deadline {
            if self
                .store
                .get("all-finalized", Duration::from_millis(100))
                .is_ok()
            {
                return;
            }
            let gone = match &self.world {
                Group::Shm(g) => g.peers_gone(),
                Group::Tcp(g) => g.peers_gone(),
                Group::Local(_) => true,
            };
            if gone {
                return;
            }
        }
        tracing::warn!(
            "rank 0 stops serving the rendezvous store although not every rank checked out"
        );
    }
}

impl Dist {
    /// The environment this rank was started with.
    pub fn env(&self) -> &DistEnv {
        &self.env
    }
    /// The backend in use.
    pub fn backend(&self) -> Backend {
        self.backend
    }
    /// The group of every rank.
    pub fn world(&self) -> &Group {
        &self.world
    }
    /// The job's rendezvous store.
    pub fn store(&self) -> &StoreClient {
        &self.store
    }

    /// Creates the group of world `ranks` (in that order), on this job's
    /// backend. Only its members call it, each with the same `ranks`; a
    /// call from a rank outside `ranks` is an error. Calling it again with
    /// the same ranks creates another group, with its own sequence of
    /// operations, as long as every member does so in the same order.
    pub fn new_group(&mut self, ranks: &[usize]) -> Result<Group, CommError> {
        let n = self.created.entry(ranks.to_vec()).or_insert(0);
        let name = format!("ranks{ranks:?}#{n}");
        *n += 1;
        join_group(
            &self.env,
            self.backend,
            &self.store,
            self.settings,
            self.timeout,
            &name,
            ranks,
        )
    }

    /// This rank's (replicate x shard) mesh.
    pub fn mesh(&mut self, shard_size: usize) -> Result<DeviceMesh<Group>, CommError> {
        let (rank, world) = (self.env.rank, self.env.world_size);
        DeviceMesh::new(rank, world, shard_size, |ranks| self.new_group(ranks))
    }
}

#[cfg(test)]
mod tests {
    use super::{choose_backend, token, Backend, DistEnv, MAX_TOKEN_LEN};

    #[test]
    fn shm_on_one_host_tcp_across_hosts_and_an_override_unless_impossible() {
        assert_eq!(choose_backend(None, true).unwrap(), Backend::Shm);
        assert_eq!(choose_backend(None, false).unwrap(), Backend::Tcp);
        for same_host in [true, false] {
            assert_eq!(
                choose_backend(Some(Backend::Tcp), same_host).unwrap(),
                Backend::Tcp
            );
        }
        assert_eq!(
            choose_backend(Some(Backend::Shm), true).unwrap(),
            Backend::Shm
        );
        let e = choose_backend(Some(Backend::Shm), false)
            .unwrap_err()
            .to_string();
        assert!(e.contains("several hosts: use tcp"), "{e}");
    }

    /// Every rank of a job derives the same id; two jobs on one host (another
    /// token, or another port) never share one; the token cannot be read
    /// from it.
    #[test]
    fn a_job_id_is_the_same_on_every_rank_and_differs_between_jobs() {
        let env = |token: String, master_port: u16, rank: usize| DistEnv {
            rank,
            world_size: 2,
            local_rank: rank,
            local_world_size: 2,
            master_addr: "127.0.0.1".into(),
            master_port,
            token,
        };
        let mut seen = std::collections::HashSet::new();
        for i in 0..500 {
            for port in [29500, 29501] {
                let id = env(format!("job-{i}"), port, 0).job_id();
                assert_eq!(id, env(format!("job-{i}"), port, 1).job_id());
                assert!(id.len() == 16 && !id.contains("job"), "{id}");
                assert!(seen.insert(id), "job {i} port {port}: id seen before");
            }
        }
    }

    #[test]
    fn a_contract_no_job_could_run_with_is_refused_naming_the_variable() {
        let good = DistEnv {
            rank: 3,
            world_size: 4,
            local_rank: 1,
            local_world_size: 2,
            master_addr: "127.0.0.1".into(),
            master_port: 29500,
            token: "t".into(),
        };
        assert!(good.check().is_ok());
        // One node: every rank of the world is local.
        let one_node = DistEnv {
            local_world_size: 4,
            ..good.clone()
        };
        assert!(one_node.check().is_ok());
        type Spoil = fn(&mut DistEnv);
        let cases: [(Spoil, &str); 4] = [
            (|e| e.rank = 4, "RANK=4 is not below WORLD_SIZE=4"),
            (
                |e| e.local_rank = 2,
                "LOCAL_RANK=2 is not below LOCAL_WORLD_SIZE=2",
            ),
            (
                |e| (e.local_world_size, e.local_rank) = (5, 4),
                "LOCAL_WORLD_SIZE=5 is more than WORLD_SIZE=4",
            ),
            (|e| e.master_port = 0, "MASTER_PORT=0 names no port"),
        ];
        for (spoil, want) in cases {
            let mut e = good.clone();
            spoil(&mut e);
            let why = e.check().unwrap_err().to_string();
            assert!(why.contains(want), "{why}");
        }
    }

    #[test]
    fn a_missing_or_blank_token_is_refused_with_how_to_make_one() {
        for (v, why) in [(None, "is not set"), (Some(" "), "is empty")] {
            let e = token(v.map(String::from)).unwrap_err().to_string();
            assert!(
                e.contains(&format!("ZRT_TOKEN {why}")) && e.contains("export ZRT_TOKEN="),
                "{e}"
            );
        }
        assert_eq!(token(Some("s3cret".into())).unwrap(), "s3cret");
        let longest = "t".repeat(MAX_TOKEN_LEN);
        assert_eq!(token(Some(longest.clone())).unwrap(), longest);
        let e = token(Some(longest + "t")).unwrap_err().to_string();
        assert!(
            e.contains("ZRT_TOKEN is 257 bytes; the store accepts at most 256"),
            "{e}"
        );
    }
}

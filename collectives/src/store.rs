//! The rendezvous store: a small TCP key-value server that ranks use to find
//! each other, as torch's TCPStore.
//!
//! Rank 0 serves it on `MASTER_ADDR:MASTER_PORT`, bound to that address only
//! (not every interface). Every connection must first present the job's
//! token (made by `zrt launch`, passed as `ZRT_TOKEN`); a connection that
//! does not, within 5 seconds, is closed having seen nothing. Each
//! connection has its own thread, so a stray or hostile client can neither
//! read data, register as a rank, nor stall the job.
//!
//! Wire format, all integers little-endian: a request is `op: u8`,
//! `key_len: u32`, key bytes, then per op: SET `len: u64` + value; GET
//! `timeout_ms: u64`; ADD `delta: i64`; DEL nothing; ON_CLOSE nothing (the
//! server sets `key`, empty, once this connection ends); COUNT_ON_CLOSE
//! nothing (the server adds 1 to the integer at `key` then). A reply is
//! `status: u8` (0 ok, 1 timed out) then, for GET, `len: u64` + value, for
//! ADD `i64`.
//!
//! Each rank's connection sets `gone_key` of its rank when it ends (the
//! rank exited, died, or dropped its `Dist`), so a rank waiting for a peer's
//! step of a rendezvous or a group's join stops waiting at once, naming it,
//! instead of waiting out its timeout.
//!
//! A client waits for each reply at most its timeout (`ZRT_TIMEOUT`) beyond
//! what the request itself asked the server to wait: a store whose host
//! vanished without closing the connection (power lost, network cut) is
//! an error naming it, never a hang.

use std::collections::HashMap;
use std::io::{Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream, ToSocketAddrs};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::{Condvar, Mutex};

use crate::still_waiting::StillWaiting;
use crate::CommError;

const HELLO_TIMEOUT: Duration = Duration::from_secs(5);
/// The longest job token (`ZRT_TOKEN`) the store and the tcp backend
/// accept, in bytes: a hello announcing more is refused unread.
pub const MAX_TOKEN_LEN: usize = 256;
const MAX_KEY: usize = 4096;
const MAX_VALUE: u64 = 1 << 30;

const OP_SET: u8 = 1;
const OP_GET: u8 = 2;
const OP_ADD: u8 = 3;
const OP_DEL: u8 = 4;
const OP_ON_CLOSE: u8 = 5;
const OP_COUNT_ON_CLOSE: u8 = 6;

/// The least a client waits for a reply beyond the wait it asked for,
/// whatever its timeout: a job run with a short `ZRT_TIMEOUT` on a loaded
/// host must not take a slow reply for a lost store.
const MIN_PATIENCE: Duration = Duration::from_secs(10);

/// How often [`StoreClient::await_key`] looks at the keys that end a wait.
const POLL: Duration = Duration::from_millis(100);

/// The key a rank's store connection sets when it ends
/// ([`StoreClient::set_on_close`]): that rank left the job.
pub(crate) fn gone_key(rank: usize) -> String {
    format!("gone/{rank}")
}

/// Waits for world rank `rank`'s `key` (its step of a join), failing at
/// once, naming the rank and `what` step it missed, when that rank's store
/// connection ended, or at `timeout` when the rank is alive but did not get
/// there.
pub(crate) fn await_rank(
    store: &StoreClient,
    key: &str,
    rank: usize,
    timeout: Duration,
    what: impl Fn() -> String,
) -> Result<Vec<u8>, CommError> {
    let say = |m: String| tracing::warn!("{m}");
    await_rank_saying(store, key, rank, timeout, what, StillWaiting::new(), say)
}

/// [`await_rank`], saying through `say` that it still waits when `waits`
/// has a report due.
fn await_rank_saying(
    store: &StoreClient,
    key: &str,
    rank: usize,
    timeout: Duration,
    what: impl Fn() -> String,
    mut waits: StillWaiting,
    mut say: impl FnMut(String),
) -> Result<Vec<u8>, CommError> {
    let still = |waited: Duration| {
        say(format!(
            "still waiting after {:.0} s for rank {rank} to {} (is it stuck, or does it not make that call? the wait fails at {:.0} s, ZRT_TIMEOUT)",
            waited.as_secs_f64(),
            what(),
            timeout.as_secs_f64()
        ));
        Ok(())
    };
    match store.await_key_saying(key, &[&gone_key(rank)], timeout, &mut waits, still)? {
        Awaited::Value(v) => Ok(v),
        Awaited::Ended(..) => Err(err(format!(
            "rank {rank} left the job before it could {}: its process exited, died or dropped its `Dist` (its rendezvous store connection closed); check that rank's output",
            what()
        ))),
        Awaited::TimedOut => Err(err(format!(
            "rank {rank} did not {} within {timeout:?}: check that rank's output, it is stuck or has not called it",
            what(),
        ))),
    }
}

/// How [`StoreClient::await_key`] ended.
#[derive(Debug, PartialEq)]
pub(crate) enum Awaited {
    /// The key's value.
    Value(Vec<u8>),
    /// The `i`th of the keys that end the wait appeared first, with its value.
    Ended(usize, Vec<u8>),
    /// Neither within the timeout.
    TimedOut,
}

fn err(why: impl Into<String>) -> CommError {
    CommError::Rendezvous(why.into())
}

fn io(what: &str, e: std::io::Error) -> CommError {
    err(format!("{what}: {e}"))
}

/// Compares without an early exit, so timing does not reveal the token
/// (the store's and the tcp backend's hello both use it).
pub(crate) fn same_token(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

#[derive(Default)]
struct Table {
    map: Mutex<HashMap<String, Vec<u8>>>,
    changed: Condvar,
}

/// A port for a job's store on `addr`, chosen below the kernel's ephemeral
/// range (Linux: 32768-60999). Probing for a free port with `bind(:0)` and
/// handing it to rank 0 races with every listener that binds port 0 in the
/// meantime (the tcp backend's own listeners, other jobs); a port outside
/// the range can only collide with another job that chose it too, which the
/// probe here makes unlikely.
pub fn free_store_port(addr: &str) -> Result<u16, CommError> {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64);
    first_free_port(addr, port_candidates(nanos, std::process::id()))
}

/// The ports [`free_store_port`] tries, in order: 256 draws from
/// 20000-31999 of a xorshift seeded by the clock and the process id, so two
/// jobs started in the same nanosecond still try different ports.
fn port_candidates(nanos: u64, pid: u32) -> impl Iterator<Item = u16> {
    let mut s = nanos ^ (u64::from(pid) << 32) | 1;
    (0..256).map(move |_| {
        s ^= s << 13;
        s ^= s >> 7;
        s ^= s << 17;
        20_000 + (s % 12_000) as u16
    })
}

/// The first of `candidates` that `addr` can listen on. A port in use moves
/// on to the next; any other failure is about the address and ends the
/// search with an error saying so.
fn first_free_port(addr: &str, candidates: impl Iterator<Item = u16>) -> Result<u16, CommError> {
    for port in candidates {
        match TcpListener::bind((addr, port)) {
            Ok(_) => return Ok(port),
            Err(e) if e.kind() == std::io::ErrorKind::AddrInUse => {}
            Err(e) => {
                return Err(err(format!(
                    "cannot listen on {addr}: {e}; the master address must name this host \
                     (the node of rank 0), e.g. --master-addr 127.0.0.1 on one machine"
                )))
            }
        }
    }
    Err(err(format!(
        "no free port for the rendezvous store on {addr} in 20000-31999: pass --master-port"
    )))
}

/// The server side; dropping it stops accepting (open connections end
/// when their clients hang up).
pub struct StoreServer {
    addr: std::net::SocketAddr,
    stop: Arc<AtomicBool>,
}

impl StoreServer {
    /// Binds `addr` (e.g. `127.0.0.1:29500`) and serves in the background.
    pub fn serve(addr: &str, token: &str) -> Result<Self, CommError> {
        let listener = TcpListener::bind(addr)
            .map_err(|e| io(&format!("cannot listen on {addr} (MASTER_ADDR:MASTER_PORT); is another job using the port?"), e))?;
        let local = listener.local_addr().map_err(|e| io("local address", e))?;
        let stop = Arc::new(AtomicBool::new(false));
        let table = Arc::new(Table::default());
        let token = token.as_bytes().to_vec();
        let s = stop.clone();
        std::thread::Builder::new()
            .name("zrt-store".into())
            .spawn(move || {
                for conn in listener.incoming() {
                    if s.load(Ordering::SeqCst) {
                        break;
                    }
                    let Ok(conn) = conn else { continue };
                    let (table, token) = (table.clone(), token.clone());
                    let _ = std::thread::Builder::new()
                        .name("zrt-store-conn".into())
                        .spawn(move || serve_conn(conn, &table, &token));
                }
            })
            .map_err(|e| io("starting the store thread", e))?;
        Ok(Self { addr: local, stop })
    }

    /// The address it listens on (useful with port 0).
    pub fn addr(&self) -> std::net::SocketAddr {
        self.addr
    }
}

impl Drop for StoreServer {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        // Wake the accept loop so it sees the flag.
        let _ = TcpStream::connect_timeout(&self.addr, Duration::from_millis(200));
    }
}

fn read_exact(c: &mut TcpStream, n: usize) -> std::io::Result<Vec<u8>> {
    let mut b = vec![0u8; n];
    c.read_exact(&mut b)?;
    Ok(b)
}

fn read_u64(c: &mut TcpStream) -> std::io::Result<u64> {
    let mut b = [0u8; 8];
    c.read_exact(&mut b)?;
    Ok(u64::from_le_bytes(b))
}

fn serve_conn(mut c: TcpStream, table: &Table, token: &[u8]) {
    let peer = c.peer_addr().map(|a| a.to_string()).unwrap_or_default();
    // Hello: u32 length + token, within HELLO_TIMEOUT, or nothing at all.
    let _ = c.set_read_timeout(Some(HELLO_TIMEOUT));
    let hello = (|| {
        let mut l = [0u8; 4];
        c.read_exact(&mut l)?;
        let n = u32::from_le_bytes(l) as usize;
        if n > MAX_TOKEN_LEN {
            return Err(std::io::Error::other("token too long"));
        }
        read_exact(&mut c, n)
    })();
    match hello {
        Ok(t) if same_token(&t, token) => {}
        _ => {
            tracing::warn!(
                peer,
                "rendezvous store: refused a connection without the job's token"
            );
            let _ = c.shutdown(Shutdown::Both);
            return;
        }
    }
    if c.write_all(&[0]).is_err() {
        return;
    }
    let _ = c.set_read_timeout(None);
    let _ = c.set_nodelay(true);
    let mut on_close = Vec::new();
    while let Ok(()) = serve_one(&mut c, table, &mut on_close) {}
    if !on_close.is_empty() {
        let mut map = table.map.lock();
        for (k, count) in on_close {
            let v = match count {
                false => Vec::new(),
                true => counter(map.get(&k)).wrapping_add(1).to_le_bytes().to_vec(),
            };
            map.insert(k, v);
        }
        drop(map);
        table.changed.notify_all();
    }
}

/// The integer an `ADD` keeps at a key (0 for none or anything else).
fn counter(v: Option<&Vec<u8>>) -> i64 {
    v.and_then(|v| v.as_slice().try_into().ok())
        .map_or(0, i64::from_le_bytes)
}

/// What a connection's end does to each key it registered: set it empty
/// (`false`) or add 1 to it (`true`).
type OnClose = Vec<(String, bool)>;

fn serve_one(c: &mut TcpStream, table: &Table, on_close: &mut OnClose) -> std::io::Result<()> {
    let mut head = [0u8; 5];
    c.read_exact(&mut head)?;
    let klen = u32::from_le_bytes([head[1], head[2], head[3], head[4]]) as usize;
    if klen > MAX_KEY {
        return Err(std::io::Error::other("key too long"));
    }
    let key = String::from_utf8(read_exact(c, klen)?).map_err(std::io::Error::other)?;
    match head[0] {
        OP_SET => {
            let n = read_u64(c)?;
            if n > MAX_VALUE {
                return Err(std::io::Error::other("value too large"));
            }
            let v = read_exact(c, n as usize)?;
            table.map.lock().insert(key, v);
            table.changed.notify_all();
            c.write_all(&[0])
        }
        OP_GET => {
            let deadline = crate::work::deadline_in(Duration::from_millis(read_u64(c)?));
            let mut map = table.map.lock();
            loop {
                if let Some(v) = map.get(&key) {
                    let mut out = Vec::with_capacity(9 + v.len());
                    out.push(0);
                    out.extend_from_slice(&(v.len() as u64).to_le_bytes());
                    out.extend_from_slice(v);
                    drop(map);
                    return c.write_all(&out);
                }
                if table.changed.wait_until(&mut map, deadline).timed_out()
                    && !map.contains_key(&key)
                {
                    drop(map);
                    return c.write_all(&[1]);
                }
            }
        }
        OP_ADD => {
            let delta = read_u64(c)? as i64;
            let mut map = table.map.lock();
            let new = counter(map.get(&key)).wrapping_add(delta);
            map.insert(key, new.to_le_bytes().to_vec());
            drop(map);
            table.changed.notify_all();
            let mut out = vec![0u8];
            out.extend_from_slice(&new.to_le_bytes());
            c.write_all(&out)
        }
        OP_DEL => {
            table.map.lock().remove(&key);
            c.write_all(&[0])
        }
        OP_ON_CLOSE | OP_COUNT_ON_CLOSE => {
            // Bounded like everything a connection can make the server keep.
            if on_close.len() >= 16 {
                return Err(std::io::Error::other("too many ON_CLOSE keys"));
            }
            on_close.push((key, head[0] == OP_COUNT_ON_CLOSE));
            c.write_all(&[0])
        }
        _ => Err(std::io::Error::other("unknown op")),
    }
}

/// A rank's connection to the store. Calls are serialized on one connection.
pub struct StoreClient {
    conn: Mutex<TcpStream>,
    addr: String,
    /// How long a reply may take beyond the wait a request asks for.
    patience: Duration,
}

impl StoreClient {
    /// Connects (retrying until `timeout`, since rank 0 may not be serving
    /// yet, and saying so now and then while it is not) and presents
    /// `token`.
    pub fn connect(addr: &str, token: &str, timeout: Duration) -> Result<Self, CommError> {
        // A warning, as the rendezvous's (`rendezvous::meet`).
        let say = |m: String| tracing::warn!("{m}");
        Self::connect_saying(addr, token, timeout, StillWaiting::new(), say)
    }

    /// [`StoreClient::connect`], saying through `say` that it still waits
    /// when `waits` has a report due.
    fn connect_saying(
        addr: &str,
        token: &str,
        timeout: Duration,
        mut waits: StillWaiting,
        mut say: impl FnMut(String),
    ) -> Result<Self, CommError> {
        let deadline = crate::work::deadline_in(timeout);
        let target = addr
            .to_socket_addrs()
            .map_err(|e| {
                io(
                    &format!("cannot resolve MASTER_ADDR:MASTER_PORT `{addr}`"),
                    e,
                )
            })?
            .next()
            .ok_or_else(|| err(format!("`{addr}` resolves to no address")))?;
        let mut c = loop {
            match TcpStream::connect_timeout(&target, Duration::from_secs(1)) {
                Ok(c) => break c,
                Err(e) if Instant::now() >= deadline => {
                    return Err(io(
                        &format!(
                            "no rendezvous store at {addr} after {:.0} s (is rank 0 running?)",
                            timeout.as_secs_f64()
                        ),
                        e,
                    ))
                }
                Err(_) => {
                    if let Some(waited) = waits.due() {
                        say(format!(
                            "no rendezvous store at {addr} after {:.0} s: waiting for rank 0 to start it (is rank 0's launcher running, with this MASTER_ADDR:MASTER_PORT? the wait fails at {:.0} s, ZRT_TIMEOUT)",
                            waited.as_secs_f64(),
                            timeout.as_secs_f64()
                        ));
                    }
                    std::thread::sleep(Duration::from_millis(50));
                }
            }
        };
        let _ = c.set_nodelay(true);
        let mut hello = (token.len() as u32).to_le_bytes().to_vec();
        hello.extend_from_slice(token.as_bytes());
        c.write_all(&hello)
            .map_err(|e| io("sending the token", e))?;
        let mut ok = [0u8; 1];
        c.read_exact(&mut ok)
            .map_err(|_| err(format!("the store at {addr} refused this rank's token: ZRT_TOKEN must be the one `zrt launch` gave the job")))?;
        Ok(Self {
            conn: Mutex::new(c),
            addr: addr.to_string(),
            patience: timeout.max(MIN_PATIENCE),
        })
    }

    /// The same client, waiting `patience` for each reply (tests of a
    /// store that stops answering).
    #[cfg(test)]
    fn with_patience(mut self, patience: Duration) -> Self {
        self.patience = patience;
        self
    }

    /// Sends one request and reads its reply, which the server may hold for
    /// `wait` (a GET's); `reply_len` is the reply's fixed length, `None`
    /// for one that gives its length.
    fn request(
        &self,
        op: u8,
        key: &str,
        body: &[u8],
        reply_len: Option<usize>,
        wait: Duration,
    ) -> Result<Option<Vec<u8>>, CommError> {
        let mut c = self.conn.lock();
        let mut msg = vec![op];
        msg.extend_from_slice(&(key.len() as u32).to_le_bytes());
        msg.extend_from_slice(key.as_bytes());
        msg.extend_from_slice(body);
        let patience = self.patience;
        let lost = |c: &TcpStream, e: std::io::Error| {
            use std::io::ErrorKind::{TimedOut, WouldBlock};
            if !matches!(e.kind(), WouldBlock | TimedOut) {
                return io(
                    &format!("lost the rendezvous store at {} (rank 0 gone?)", self.addr),
                    e,
                );
            }
            // A reply that comes later would be read as the next one's:
            // the connection is done with.
            let _ = c.shutdown(Shutdown::Both);
            err(format!(
                "the rendezvous store at {} did not answer within {:.0} s (ZRT_TIMEOUT): its host is gone or cut off from this one",
                self.addr,
                patience.as_secs_f64()
            ))
        };
        c.set_write_timeout(Some(patience))
            .and_then(|()| c.set_read_timeout(Some(wait.saturating_add(patience))))
            .map_err(|e| io("setting the store connection's timeouts", e))?;
        let mut reply = || -> std::io::Result<Option<Vec<u8>>> {
            c.write_all(&msg)?;
            let mut status = [0u8; 1];
            c.read_exact(&mut status)?;
            if status[0] == 1 {
                return Ok(None);
            }
            let n = match reply_len {
                Some(n) => n,
                None => read_u64(&mut c)? as usize,
            };
            read_exact(&mut c, n).map(Some)
        };
        let r = reply();
        r.map_err(|e| lost(&c, e))
    }

    /// The local address of this connection: the IP this host uses to reach
    /// rank 0, which is what peers on other hosts can reach too.
    pub fn local_ip(&self) -> Result<std::net::IpAddr, CommError> {
        self.conn
            .lock()
            .local_addr()
            .map(|a| a.ip())
            .map_err(|e| io("local address", e))
    }

    /// Sets `key` to `value`.
    pub fn set(&self, key: &str, value: &[u8]) -> Result<(), CommError> {
        let mut body = (value.len() as u64).to_le_bytes().to_vec();
        body.extend_from_slice(value);
        self.request(OP_SET, key, &body, Some(0), Duration::ZERO)
            .map(|_| ())
    }

    /// Waits for `key` to exist (at most `timeout`) and returns its value.
    pub fn get(&self, key: &str, timeout: Duration) -> Result<Vec<u8>, CommError> {
        self.get_within(key, timeout)?.ok_or_else(|| {
            err(format!(
                "key `{key}` did not appear in the store within {:.0} s",
                timeout.as_secs_f64()
            ))
        })
    }

    /// As [`StoreClient::get`], with `None` when `key` did not appear
    /// within `timeout` (zero: whether it exists now).
    pub fn get_within(&self, key: &str, timeout: Duration) -> Result<Option<Vec<u8>>, CommError> {
        let body = (timeout.as_millis() as u64).to_le_bytes();
        self.request(OP_GET, key, &body, None, timeout)
    }

    /// Adds `delta` to the integer at `key` (0 if absent); returns the new value.
    pub fn add(&self, key: &str, delta: i64) -> Result<i64, CommError> {
        let v = self
            .request(OP_ADD, key, &delta.to_le_bytes(), Some(8), Duration::ZERO)?
            .unwrap_or_default();
        Ok(i64::from_le_bytes(
            v.as_slice()
                .try_into()
                .map_err(|_| err("malformed ADD reply"))?,
        ))
    }

    /// Removes `key`.
    pub fn delete(&self, key: &str) -> Result<(), CommError> {
        self.request(OP_DEL, key, &[], Some(0), Duration::ZERO)
            .map(|_| ())
    }

    /// Makes the server set `key` (empty) once this connection ends, however
    /// it ends: a killed process's connection ends too.
    pub fn set_on_close(&self, key: &str) -> Result<(), CommError> {
        self.request(OP_ON_CLOSE, key, &[], Some(0), Duration::ZERO)
            .map(|_| ())
    }

    /// Makes the server add 1 to the integer at `key` (as [`Self::add`])
    /// once this connection ends, however it ends: one key that counts the
    /// connections gone, which a watcher reads in one request however many
    /// peers it watches.
    pub fn count_on_close(&self, key: &str) -> Result<(), CommError> {
        self.request(OP_COUNT_ON_CLOSE, key, &[], Some(0), Duration::ZERO)
            .map(|_| ())
    }

    /// [`StoreClient::await_key`], calling `still` with the time waited
    /// whenever `waits` has a report due meanwhile (an error from it ends
    /// the wait).
    pub(crate) fn await_key_saying(
        &self,
        key: &str,
        unless: &[&str],
        timeout: Duration,
        waits: &mut StillWaiting,
        mut still: impl FnMut(Duration) -> Result<(), CommError>,
    ) -> Result<Awaited, CommError> {
        let deadline = crate::work::deadline_in(timeout);
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            let part = left.min(waits.until_due());
            match self.await_key(key, unless, part)? {
                Awaited::TimedOut if part < left => {
                    if let Some(waited) = waits.due() {
                        still(waited)?;
                    }
                }
                awaited => return Ok(awaited),
            }
        }
    }

    /// Waits for `key` at most `timeout`, ending early when one of `unless`
    /// appears (looked at every 100 ms): a peer's step of a rendezvous
    /// against that peer's [`gone_key`], or a job's abort.
    pub(crate) fn await_key(
        &self,
        key: &str,
        unless: &[&str],
        timeout: Duration,
    ) -> Result<Awaited, CommError> {
        let deadline = crate::work::deadline_in(timeout);
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            if let Some(v) = self.get_within(key, left.min(POLL))? {
                return Ok(Awaited::Value(v));
            }
            for (i, k) in unless.iter().enumerate() {
                if let Some(v) = self.get_within(k, Duration::ZERO)? {
                    return Ok(Awaited::Ended(i, v));
                }
            }
            if left.is_zero() {
                return Ok(Awaited::TimedOut);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_rank_waiting_for_the_store_says_so_until_it_comes() {
        // A port nobody serves yet, below the ephemeral range so that no
        // other test's listener on port 0 takes it during the wait.
        let addr: std::net::SocketAddr =
            format!("127.0.0.1:{}", free_store_port("127.0.0.1").unwrap())
                .parse()
                .unwrap();
        let ms = Duration::from_millis;
        let serving = std::thread::spawn(move || {
            std::thread::sleep(ms(450));
            StoreServer::serve(&addr.to_string(), "tok").unwrap()
        });
        let mut said = Vec::new();
        let waits = StillWaiting::every(ms(100), ms(100));
        let c = StoreClient::connect_saying(&addr.to_string(), "tok", ms(30_000), waits, |m| {
            said.push((Instant::now(), m))
        });
        let _srv = serving.join().unwrap();
        c.unwrap().set("x", b"1").unwrap();
        // One report a period, however often the wait looks.
        crate::still_waiting::assert_a_period_apart(&said, ms(100));
        for (_, m) in &said {
            assert!(
                m.starts_with(&format!("no rendezvous store at {addr} after "))
                    && m.ends_with(" s: waiting for rank 0 to start it (is rank 0's launcher running, with this MASTER_ADDR:MASTER_PORT? the wait fails at 30 s, ZRT_TIMEOUT)"),
                "{m}"
            );
        }
    }

    #[test]
    fn a_join_waiting_for_a_rank_says_so_until_its_timeout() {
        let srv = StoreServer::serve("127.0.0.1:0", "tok").unwrap();
        let c =
            StoreClient::connect(&srv.addr().to_string(), "tok", Duration::from_secs(5)).unwrap();
        let ms = Duration::from_millis;
        let mut said = Vec::new();
        let waits = StillWaiting::every(ms(100), ms(100));
        let what = || "join shared-memory group `g`".to_string();
        let e = await_rank_saying(&c, "never", 3, ms(450), what, waits, |m| {
            said.push((Instant::now(), m))
        })
        .unwrap_err()
        .to_string();
        assert!(
            e.contains("rank 3 did not join shared-memory group `g` within 450ms"),
            "{e}"
        );
        // One report a period, however often the wait looks.
        crate::still_waiting::assert_a_period_apart(&said, ms(100));
        for (_, m) in &said {
            assert!(
                m.starts_with("still waiting after ")
                    && m.ends_with(" s for rank 3 to join shared-memory group `g` (is it stuck, or does it not make that call? the wait fails at 0 s, ZRT_TIMEOUT)"),
                "{m}"
            );
        }
    }

    #[test]
    fn a_connection_that_ends_sets_its_keys_and_ends_waits_on_them() {
        let srv = StoreServer::serve("127.0.0.1:0", "tok").unwrap();
        let addr = srv.addr().to_string();
        let t = Duration::from_secs(5);
        let (a, b) = (
            StoreClient::connect(&addr, "tok", t).unwrap(),
            StoreClient::connect(&addr, "tok", t).unwrap(),
        );
        a.set_on_close(&gone_key(3)).unwrap();
        assert_eq!(b.get_within("gone/3", Duration::ZERO).unwrap(), None);
        b.set("x", b"1").unwrap();
        assert_eq!(
            b.await_key("x", &["other", "gone/3"], t).unwrap(),
            Awaited::Value(b"1".to_vec())
        );
        assert_eq!(
            b.await_key("y", &["gone/3"], Duration::from_millis(150))
                .unwrap(),
            Awaited::TimedOut
        );
        let waiting = std::thread::spawn(move || {
            let at = Instant::now();
            (
                b.await_key("y", &["other", "gone/3"], t).unwrap(),
                at.elapsed(),
            )
        });
        std::thread::sleep(Duration::from_millis(200));
        drop(a);
        let (got, took) = waiting.join().unwrap();
        assert_eq!(got, Awaited::Ended(1, Vec::new()));
        assert!(took < Duration::from_secs(2), "{took:?}");
        // A connection cannot make the server keep keys without bound.
        let c = StoreClient::connect(&addr, "tok", t).unwrap();
        for i in 0..16 {
            c.set_on_close(&format!("k{i}")).unwrap();
        }
        assert!(c.set_on_close("k16").is_err());
    }

    #[test]
    fn a_store_that_stops_answering_is_an_error_naming_it_not_a_hang() {
        // A store whose host is cut off: it took the hello, then never
        // answers (and never closes the connection).
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap().to_string();
        let silent = std::thread::spawn(move || {
            let (mut c, _) = l.accept().unwrap();
            let mut len = [0u8; 4];
            c.read_exact(&mut len).unwrap();
            read_exact(&mut c, u32::from_le_bytes(len) as usize).unwrap();
            c.write_all(&[0]).unwrap();
            // Holds the connection until the client shuts it.
            let mut sink = Vec::new();
            let _ = c.read_to_end(&mut sink);
        });
        let patience = Duration::from_secs(1);
        let c = StoreClient::connect(&addr, "tok", patience)
            .unwrap()
            .with_patience(patience);
        for (wait, request) in [(Duration::ZERO, "add"), (Duration::from_millis(300), "get")] {
            let t0 = Instant::now();
            let e = match request {
                "add" => c.add("k", 1).unwrap_err(),
                _ => c.get_within("k", wait).unwrap_err(),
            };
            let took = t0.elapsed();
            let e = e.to_string();
            match request {
                // The first request waits out its patience beyond the
                // wait it asked for...
                "add" => {
                    assert!(
                        e.contains(&format!("the rendezvous store at {addr} did not answer within 1 s (ZRT_TIMEOUT): its host is gone or cut off")),
                        "{e}"
                    );
                    assert!(
                        took >= patience && took < Duration::from_secs(5),
                        "{took:?}"
                    );
                }
                // ... and the connection is done with after it.
                _ => {
                    assert!(e.contains("lost the rendezvous store"), "{e}");
                    assert!(took < patience, "{took:?}");
                }
            }
        }
        drop(c);
        silent.join().unwrap();
        // A GET's own wait is not cut short by the patience.
        let srv = StoreServer::serve("127.0.0.1:0", "tok").unwrap();
        let c = StoreClient::connect(&srv.addr().to_string(), "tok", patience)
            .unwrap()
            .with_patience(patience);
        let t0 = Instant::now();
        assert_eq!(
            c.get_within("k", Duration::from_millis(1500)).unwrap(),
            None
        );
        assert!(t0.elapsed() >= Duration::from_millis(1500));
    }

    #[test]
    fn connections_that_end_are_counted_at_a_key() {
        let srv = StoreServer::serve("127.0.0.1:0", "tok").unwrap();
        let addr = srv.addr().to_string();
        let t = Duration::from_secs(5);
        let watcher = StoreClient::connect(&addr, "tok", t).unwrap();
        let peers: Vec<_> = (0..3)
            .map(|_| {
                let c = StoreClient::connect(&addr, "tok", t).unwrap();
                c.count_on_close("gone").unwrap();
                c
            })
            .collect();
        assert_eq!(watcher.add("gone", 0).unwrap(), 0);
        let mut peers = peers.into_iter();
        for n in 1..=2 {
            drop(peers.next());
            let t0 = Instant::now();
            while watcher.add("gone", 0).unwrap() < n {
                assert!(t0.elapsed() < t, "connection {n}'s end never counted");
                std::thread::sleep(Duration::from_millis(5));
            }
            assert_eq!(watcher.add("gone", 0).unwrap(), n);
        }
        // A count the server keeps adds to what ADD put there.
        watcher.add("gone", 10).unwrap();
        drop(peers.next());
        let t0 = Instant::now();
        while watcher.add("gone", 0).unwrap() != 13 {
            assert!(t0.elapsed() < t, "the last end never counted");
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    #[test]
    fn set_get_add_delete_and_blocking_get() {
        let srv = StoreServer::serve("127.0.0.1:0", "tok").unwrap();
        let addr = srv.addr().to_string();
        let a = StoreClient::connect(&addr, "tok", Duration::from_secs(5)).unwrap();
        let b = StoreClient::connect(&addr, "tok", Duration::from_secs(5)).unwrap();
        a.set("k", b"v").unwrap();
        assert_eq!(b.get("k", Duration::from_secs(1)).unwrap(), b"v");
        assert_eq!(a.add("n", 2).unwrap(), 2);
        assert_eq!(b.add("n", 3).unwrap(), 5);
        let t = std::thread::spawn(move || b.get("later", Duration::from_secs(5)).unwrap());
        std::thread::sleep(Duration::from_millis(50));
        a.set("later", b"x").unwrap();
        assert_eq!(t.join().unwrap(), b"x");
        a.delete("k").unwrap();
        let e = a
            .get("k", Duration::from_millis(50))
            .unwrap_err()
            .to_string();
        assert!(e.contains("key `k` did not appear"), "{e}");
    }

    #[test]
    fn a_wrong_token_gets_nothing_and_a_silent_client_stalls_nobody() {
        let srv = StoreServer::serve("127.0.0.1:0", "secret").unwrap();
        let addr = srv.addr().to_string();
        let good = StoreClient::connect(&addr, "secret", Duration::from_secs(5)).unwrap();
        good.set("weights", b"private").unwrap();
        // A stray connection that says nothing holds only its own thread.
        let _silent = TcpStream::connect(&addr).unwrap();
        // Wrong tokens of another length and of the same length.
        for guess in ["guess", "secreT"] {
            let e = StoreClient::connect(&addr, guess, Duration::from_secs(5))
                .err()
                .unwrap()
                .to_string();
            assert!(e.contains("refused this rank's token"), "{guess}: {e}");
        }
        // A raw client that skips the hello and asks for a key gets no data.
        let mut raw = TcpStream::connect(&addr).unwrap();
        let mut req = vec![OP_GET];
        req.extend_from_slice(&7u32.to_le_bytes());
        req.extend_from_slice(b"weights");
        req.extend_from_slice(&0u64.to_le_bytes());
        let _ = raw.write_all(&req);
        let mut buf = Vec::new();
        let _ = raw.set_read_timeout(Some(Duration::from_secs(6)));
        let _ = raw.read_to_end(&mut buf);
        assert!(
            !buf.windows(7).any(|w| w == b"private"),
            "leaked data to an unauthenticated client"
        );
        // And the job goes on.
        assert_eq!(
            good.get("weights", Duration::from_secs(1)).unwrap(),
            b"private"
        );
    }

    #[test]
    fn a_token_of_the_longest_length_is_admitted() {
        let token = "t".repeat(MAX_TOKEN_LEN);
        let srv = StoreServer::serve("127.0.0.1:0", &token).unwrap();
        let addr = srv.addr().to_string();
        let c = StoreClient::connect(&addr, &token, Duration::from_secs(5)).unwrap();
        c.set("k", b"v").unwrap();
    }

    #[test]
    fn keys_up_to_the_limit_are_served_and_a_longer_one_ends_the_connection() {
        let srv = StoreServer::serve("127.0.0.1:0", "tok").unwrap();
        let addr = srv.addr().to_string();
        let c = StoreClient::connect(&addr, "tok", Duration::from_secs(5)).unwrap();
        let longest = "k".repeat(MAX_KEY);
        c.set(&longest, b"v").unwrap();
        assert_eq!(c.get(&longest, Duration::from_secs(1)).unwrap(), b"v");
        let e = c.set(&(longest + "k"), b"v").unwrap_err().to_string();
        assert!(e.contains("lost the rendezvous store"), "{e}");
    }

    #[test]
    fn a_rank_waits_for_the_store_to_come_up_and_no_longer_than_its_timeout() {
        // A port below the ephemeral range, as `zrt launch` picks: one
        // probed with `bind(:0)` could be taken during the wait below by
        // another test's listener on port 0 (CI once saw this client reach
        // such a store and be refused its token).
        let unused = || format!("127.0.0.1:{}", free_store_port("127.0.0.1").unwrap());
        let addr = unused();
        // Rank 0 is not serving yet: the others retry until it does.
        let a = addr.clone();
        let early = std::thread::spawn(move || {
            StoreClient::connect(&a, "tok", Duration::from_secs(10)).map(|_| ())
        });
        std::thread::sleep(Duration::from_millis(300));
        let _srv = StoreServer::serve(&addr, "tok").unwrap();
        early.join().unwrap().unwrap();
        // Nobody ever serves: an error naming the address, once the timeout is up.
        let addr = unused();
        let (tx, rx) = crossbeam_channel::bounded(1);
        let a = addr.clone();
        let t = Instant::now();
        std::thread::spawn(move || {
            let r = StoreClient::connect(&a, "tok", Duration::from_millis(300));
            let _ = tx.send(r.err().map(|e| e.to_string()));
        });
        let e = rx
            .recv_timeout(Duration::from_secs(5))
            .expect("still connecting 5 s into a 0.3 s timeout")
            .expect("connected to nothing");
        assert!(e.contains(&format!("no rendezvous store at {addr}")), "{e}");
        assert!(
            t.elapsed() >= Duration::from_millis(300),
            "{:?}",
            t.elapsed()
        );
    }

    #[test]
    fn tokens_match_only_byte_for_byte() {
        assert!(same_token(b"secret", b"secret"));
        assert!(same_token(b"", b""));
        for other in [&b"Secret"[..], b"secreT", b"secre", b"secrets", b""] {
            assert!(!same_token(b"secret", other), "{other:?}");
        }
    }

    #[test]
    fn store_ports_are_spread_below_the_ephemeral_range_and_differ_by_process() {
        let a: Vec<u16> = port_candidates(1_700_000_000_123_456_789, 4242).collect();
        assert_eq!(a.len(), 256);
        assert!(a.iter().all(|p| (20_000..32_000).contains(p)), "{a:?}");
        let distinct: std::collections::HashSet<_> = a.iter().collect();
        assert!(
            distinct.len() > 240,
            "only {} distinct ports",
            distinct.len()
        );
        // Two jobs started in the same nanosecond try different ports.
        let b: Vec<u16> = port_candidates(1_700_000_000_123_456_789, 4243).collect();
        assert!(a.iter().zip(&b).filter(|(x, y)| x == y).count() < 8);
    }

    #[test]
    fn a_port_in_use_is_skipped_and_a_foreign_address_is_named() {
        let taken = TcpListener::bind("127.0.0.1:0").unwrap();
        let busy = taken.local_addr().unwrap().port();
        let free = free_store_port("127.0.0.1").unwrap();
        assert_eq!(
            first_free_port("127.0.0.1", [busy, free].into_iter()).unwrap(),
            free
        );
        let e = first_free_port("127.0.0.1", [busy].into_iter())
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("no free port") && e.contains("--master-port"),
            "{e}"
        );
        // 192.0.2.1 (TEST-NET-1) is no address of this host: one try, named.
        let e = first_free_port("192.0.2.1", [free, busy].into_iter())
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("cannot listen on 192.0.2.1") && e.contains("must name this host"),
            "{e}"
        );
        let p = free_store_port("127.0.0.1").unwrap();
        assert!((20_000..32_000).contains(&p), "{p}");
    }

    #[test]
    fn a_dropped_server_stops_accepting() {
        let srv = StoreServer::serve("127.0.0.1:0", "tok").unwrap();
        let addr = srv.addr().to_string();
        drop(srv);
        // The accept loop exits on the wake-up connection and closes the
        // listener; give its thread a moment.
        let t = Instant::now();
        while TcpStream::connect(&addr).is_ok() {
            assert!(
                t.elapsed() < Duration::from_secs(5),
                "still accepting connections 5 s after the server was dropped"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

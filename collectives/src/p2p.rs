//! Point-to-point messages through the rendezvous store, for the process
//! backends (shm, tcp). `send`/`recv` are rare in ZeRO, so they favour
//! being simple and correct over speed: the n-th message from a rank to a
//! rank is one store key, written by the sender and taken by the receiver.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use parking_lot::Mutex;

use crate::dtype::{as_bytes, as_bytes_mut};
use crate::op::invalid;
use crate::store::StoreClient;
use crate::{CommError, Element, OpDesc};

/// How often a waiting `recv` checks whether its sender is still there.
const POLL: Duration = Duration::from_millis(200);

/// Message counters of one rank of one group.
#[derive(Default)]
pub(crate) struct Mailbox {
    sent: Mutex<HashMap<usize, u64>>,
    received: Mutex<HashMap<usize, u64>>,
}

fn next(counts: &Mutex<HashMap<usize, u64>>, peer: usize) -> u64 {
    let mut c = counts.lock();
    let n = c.entry(peer).or_insert(0);
    *n += 1;
    *n - 1
}

/// Who is talking, for keys and errors.
pub(crate) struct Peers<'a> {
    pub(crate) store: &'a StoreClient,
    pub(crate) group: &'a str,
    pub(crate) world_ranks: &'a [usize],
    pub(crate) me: usize,
}

impl Peers<'_> {
    fn key(&self, from: usize, to: usize, n: u64) -> String {
        format!("p2p/{}/{from}/{to}/{n}", self.group)
    }
}

/// The error for a `send`/`recv` whose peer cannot be valid, if it cannot.
pub(crate) fn check_peer(
    group: &str,
    desc: &OpDesc,
    peer: usize,
    me: usize,
    size: usize,
) -> Option<CommError> {
    (peer >= size || peer == me).then(|| {
        let role = if matches!(desc.kind, crate::OpKind::Send { .. }) {
            "destination"
        } else {
            "source"
        };
        invalid(
            group,
            desc,
            format!("{role} {peer} must be another rank of this group of {size}"),
        )
    })
}

impl Mailbox {
    /// Posts `buf` (described by `desc`) for group rank `to`.
    pub(crate) fn send<T: Element>(
        &self,
        p: &Peers<'_>,
        to: usize,
        desc: &OpDesc,
        buf: &[T],
    ) -> Result<(), CommError> {
        let n = next(&self.sent, to);
        let mut msg: Vec<u8> = desc.encode().iter().flat_map(|w| w.to_le_bytes()).collect();
        msg.extend_from_slice(as_bytes(buf));
        p.store.set(&p.key(p.me, to, n), &msg)
    }

    /// Takes the next message from group rank `from`, waiting at most
    /// `timeout` and failing early once `gone()` says the sender left.
    pub(crate) fn recv<T: Element>(
        &self,
        p: &Peers<'_>,
        from: usize,
        desc: &OpDesc,
        timeout: Duration,
        gone: impl Fn() -> bool,
    ) -> Result<Vec<T>, CommError> {
        let n = next(&self.received, from);
        let key = p.key(from, p.me, n);
        let deadline = crate::work::deadline_in(timeout);
        let msg = loop {
            match p.store.get(&key, POLL) {
                Ok(m) => break m,
                // A sender posts and may then leave at once: after seeing
                // it gone, look once more, or a message that came between
                // the wait and the look would be lost for a death.
                Err(_) if gone() => match p.store.get_within(&key, Duration::ZERO) {
                    Ok(Some(m)) => break m,
                    _ => {
                        return Err(CommError::RankDied {
                            group: p.group.to_string(),
                            rank: p.world_ranks[from],
                            call: desc.to_string(),
                        })
                    }
                },
                Err(_) if Instant::now() >= deadline => {
                    return Err(CommError::Timeout {
                        group: p.group.to_string(),
                        call: desc.to_string(),
                        timeout,
                        waiting_for: vec![p.world_ranks[from]],
                    })
                }
                Err(_) => {}
            }
        };
        p.store.delete(&key)?;
        let words: Vec<u64> = msg
            .chunks_exact(8)
            .take(3)
            .map(|c| u64::from_le_bytes(c.try_into().unwrap_or_default()))
            .collect();
        let sent = words.try_into().ok().and_then(OpDesc::decode);
        let data = msg.get(24..).unwrap_or_default();
        match sent {
            Some(s)
                if s.dtype == desc.dtype
                    && s.len == desc.len
                    && data.len() == desc.len * std::mem::size_of::<T>() =>
            {
                let mut out = vec![T::ZERO; desc.len];
                as_bytes_mut(&mut out).copy_from_slice(data);
                Ok(out)
            }
            s => Err(CommError::Mismatch {
                group: p.group.to_string(),
                seq: n,
                rank_a: p.world_ranks[from],
                call_a: s.map_or_else(|| "a malformed send".into(), |s| s.to_string()),
                rank_b: p.world_ranks[p.me],
                call_b: desc.to_string(),
            }),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::StoreServer;
    use crate::OpKind;

    /// Group rank `me`'s `Peers` on `store`, in a group of world ranks 0 and 1.
    fn peers<'a>(store: &'a StoreClient, me: usize) -> Peers<'a> {
        Peers {
            store,
            group: "g",
            world_ranks: &[0, 1],
            me,
        }
    }

    #[test]
    fn a_message_posted_just_before_its_sender_left_is_received() {
        let srv = StoreServer::serve("127.0.0.1:0", "t").unwrap();
        let addr = srv.addr().to_string();
        let store = StoreClient::connect(&addr, "t", Duration::from_secs(5)).unwrap();
        let (sender, receiver) = (Mailbox::default(), Mailbox::default());
        let send = OpDesc::new(OpKind::Send { to: 1 }, Some(crate::DType::I64), 3);
        let recv = OpDesc::new(OpKind::Recv { from: 0 }, Some(crate::DType::I64), 3);
        // The sender posts between the receiver's wait and its look at
        // whether the sender is gone, and is gone by that look: the race
        // of a sender that sends and exits.
        let gone = || {
            sender
                .send(&peers(&store, 0), 1, &send, &[7i64, 8, 9])
                .unwrap();
            true
        };
        let got = receiver.recv::<i64>(&peers(&store, 1), 0, &recv, Duration::from_secs(5), gone);
        assert_eq!(got.unwrap(), vec![7, 8, 9]);
        // With nothing posted, a gone sender is an error naming it.
        let e = receiver
            .recv::<i64>(&peers(&store, 1), 0, &recv, Duration::from_secs(5), || true)
            .unwrap_err();
        assert!(matches!(e, CommError::RankDied { rank: 0, .. }), "{e}");
    }
}

//! Collectives between ranks that run as threads of one process: the CPU backend's
//! communication layer, with real ring and tree algorithms (not a shared-memory shortcut),
//! so that what a partitioned program sends is what a cluster would send.
//!
//! Each rank holds a [`Communicator`]. Messages travel over channels and are matched by
//! (sender, group, call number, step), so successive collectives, and collectives of
//! different groups (the tensor-parallel group and the data-parallel group of a rank), never
//! mix. Every receive has a timeout: a rank that stops answering makes the others fail with
//! an error naming it, instead of hanging. Every rank counts the bytes it sends per kind of
//! collective, which tests compare with the compiler's communication report.

mod algorithms;
mod mesh;
pub mod pool;
mod worker;

use std::any::Any;
use std::collections::{BTreeMap, HashMap};
use std::sync::mpsc::{channel, Receiver, RecvTimeoutError, Sender};
use std::time::{Duration, Instant};

pub use algorithms::Algorithm;
pub use mesh::MeshShape;
pub use worker::AsyncComm;

/// A number that collectives can add, compare and send.
pub trait Elem: Copy + Send + Sync + PartialOrd + std::ops::Add<Output = Self> + std::ops::Mul<Output = Self> + 'static {}
impl Elem for f32 {}
impl Elem for f64 {}
impl Elem for i32 {}
impl Elem for u8 {}
/// Sums of bf16 values are computed in f32 and rounded, pairwise, as NCCL does.
impl Elem for half::bf16 {}

/// How partial values combine.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ReduceOp {
    /// Sum.
    Sum,
    /// Maximum.
    Max,
}

impl ReduceOp {
    fn apply<T: Elem>(self, a: T, b: T) -> T {
        match self {
            ReduceOp::Sum => a + b,
            ReduceOp::Max => {
                if b > a {
                    b
                } else {
                    a
                }
            }
        }
    }
}

/// Kinds of collective, for the byte counters.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum CollectiveKind {
    /// All-reduce.
    AllReduce,
    /// All-gather.
    AllGather,
    /// Reduce-scatter.
    ReduceScatter,
    /// Broadcast.
    Broadcast,
    /// Point-to-point send.
    Send,
    /// All-to-all (a part to each peer).
    AllToAll,
}

/// Why a collective failed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CommError {
    /// A peer did not send within the timeout.
    #[error("rank {rank}: no message from rank {peer} within {timeout:?} during {what}")]
    Timeout {
        /// This rank.
        rank: usize,
        /// The rank that was waited for.
        peer: usize,
        /// The timeout.
        timeout: Duration,
        /// Which collective was waiting.
        what: String,
    },
    /// A peer is gone (its thread ended or failed).
    #[error("rank {rank}: rank {peer} left during {what}")]
    PeerGone {
        /// This rank.
        rank: usize,
        /// The rank that is gone.
        peer: usize,
        /// Which collective was waiting.
        what: String,
    },
    /// Another rank failed, and the run is stopping.
    #[error("rank {rank}: stopped while waiting for rank {peer} in {what}, because another rank failed")]
    Aborted {
        /// This rank.
        rank: usize,
        /// The rank that was waited for.
        peer: usize,
        /// Which collective was waiting.
        what: String,
    },
    /// Buffers do not fit the collective.
    #[error("rank {rank}: {what}")]
    Shape {
        /// This rank.
        rank: usize,
        /// What does not fit.
        what: String,
    },
}

/// A message: sender, key, payload (a `Vec<T>` behind `Any`).
struct Message {
    from: usize,
    key: (u64, u64, u64),
    payload: Box<dyn Any + Send>,
}

/// One rank's end of the world.
pub struct Communicator {
    rank: usize,
    senders: Vec<Sender<Message>>,
    inbox: Receiver<Message>,
    /// Messages that arrived before they were asked for.
    early: HashMap<(usize, (u64, u64, u64)), Box<dyn Any + Send>>,
    /// Calls made so far per group, so each call has its own message keys.
    calls: HashMap<u64, u64>,
    timeout: Duration,
    /// Bytes sent, per kind of collective.
    sent: BTreeMap<CollectiveKind, u64>,
    /// Set when any rank of the world fails: waits end at once instead of at the timeout.
    abort: std::sync::Arc<std::sync::atomic::AtomicBool>,
}

impl std::fmt::Debug for Communicator {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Communicator").field("rank", &self.rank).field("size", &self.senders.len()).finish_non_exhaustive()
    }
}

/// Creates the communicators of `size` ranks; each receive waits at most `timeout`.
pub fn world(size: usize, timeout: Duration) -> Vec<Communicator> {
    let (senders, receivers): (Vec<_>, Vec<_>) = (0..size).map(|_| channel()).unzip();
    let abort = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    receivers
        .into_iter()
        .enumerate()
        .map(|(rank, inbox)| Communicator {
            rank,
            senders: senders.clone(),
            inbox,
            early: HashMap::new(),
            calls: HashMap::new(),
            timeout,
            sent: BTreeMap::new(),
            abort: abort.clone(),
        })
        .collect()
}

/// A stable key for a group of ranks.
fn group_key(group: &[usize]) -> u64 {
    group.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, &r| (h ^ r as u64).wrapping_mul(0x0000_0100_0000_01B3))
}

impl Communicator {
    /// This rank.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// Number of ranks in the world.
    pub fn size(&self) -> usize {
        self.senders.len()
    }

    /// Bytes this rank has sent, per kind of collective.
    pub fn bytes_sent(&self) -> &BTreeMap<CollectiveKind, u64> {
        &self.sent
    }

    /// The world's abort flag: set it when a rank fails, and every wait ends.
    pub fn abort_flag(&self) -> std::sync::Arc<std::sync::atomic::AtomicBool> {
        self.abort.clone()
    }

    /// Position of this rank in `group`, checking that it is a member.
    fn position(&self, group: &[usize]) -> Result<usize, CommError> {
        group.iter().position(|&r| r == self.rank).ok_or_else(|| CommError::Shape {
            rank: self.rank,
            what: format!("rank {} is not in the group {group:?}", self.rank),
        })
    }

    /// Starts a call on `group`: the key that tells its messages apart.
    fn begin(&mut self, group: &[usize]) -> (u64, u64) {
        let g = group_key(group);
        let call = self.calls.entry(g).or_insert(0);
        *call += 1;
        (g, *call)
    }

    fn send_raw<T: Elem>(&mut self, to: usize, key: (u64, u64, u64), data: Vec<T>, kind: CollectiveKind, what: &str) -> Result<(), CommError> {
        *self.sent.entry(kind).or_insert(0) += (data.len() * std::mem::size_of::<T>()) as u64;
        self.senders[to]
            .send(Message { from: self.rank, key, payload: Box::new(data) })
            .map_err(|_| CommError::PeerGone { rank: self.rank, peer: to, what: what.to_string() })
    }

    fn recv_raw<T: Elem>(&mut self, from: usize, key: (u64, u64, u64), what: &str) -> Result<Vec<T>, CommError> {
        // A timeout too long to add to the clock waits for ever (until the run is aborted).
        let deadline = Instant::now().checked_add(self.timeout);
        loop {
            if let Some(payload) = self.early.remove(&(from, key)) {
                return payload.downcast::<Vec<T>>().map(|b| *b).map_err(|_| CommError::Shape {
                    rank: self.rank,
                    what: format!("{what}: rank {from} sent another element type"),
                });
            }
            if self.abort.load(std::sync::atomic::Ordering::SeqCst) {
                return Err(CommError::Aborted { rank: self.rank, peer: from, what: what.to_string() });
            }
            // Wake up now and then to see whether the run is stopping.
            let left = deadline.map_or(Duration::MAX, |d| d.saturating_duration_since(Instant::now())).min(Duration::from_millis(20));
            if left.is_zero() {
                return Err(CommError::Timeout { rank: self.rank, peer: from, timeout: self.timeout, what: what.to_string() });
            }
            match self.inbox.recv_timeout(left) {
                Ok(m) => {
                    self.early.insert((m.from, m.key), m.payload);
                }
                Err(RecvTimeoutError::Timeout) => {}
                Err(RecvTimeoutError::Disconnected) => {
                    return Err(CommError::PeerGone { rank: self.rank, peer: from, what: what.to_string() });
                }
            }
        }
    }

    /// Sends `data` to rank `to` (a pipeline boundary); `tag` pairs it with the receive.
    pub fn send<T: Elem>(&mut self, to: usize, tag: u64, data: &[T]) -> Result<(), CommError> {
        self.send_owned(to, tag, pool::filled(data))
    }

    /// [`Communicator::send`] of a buffer the caller gives up (no copy; the receiver may
    /// [`pool::recycle`] it).
    pub fn send_owned<T: Elem>(&mut self, to: usize, tag: u64, data: Vec<T>) -> Result<(), CommError> {
        self.send_raw(to, (u64::MAX, tag, 0), data, CollectiveKind::Send, "send")
    }

    /// Receives what rank `from` sent with `tag` into `out`.
    pub fn recv<T: Elem>(&mut self, from: usize, tag: u64, out: &mut [T]) -> Result<(), CommError> {
        let data: Vec<T> = self.recv_owned(from, tag, out.len())?;
        out.copy_from_slice(&data);
        pool::recycle(data);
        Ok(())
    }

    /// Receives the bytes rank `from` sent with `tag`, however many.
    pub fn recv_raw_bytes(&mut self, from: usize, tag: u64) -> Result<Vec<u8>, CommError> {
        self.recv_raw(from, (u64::MAX, tag, 0), "recv")
    }

    /// Receives what rank `from` sent with `tag`, `len` elements, as the sent buffer itself.
    pub fn recv_owned<T: Elem>(&mut self, from: usize, tag: u64, len: usize) -> Result<Vec<T>, CommError> {
        let data: Vec<T> = self.recv_raw(from, (u64::MAX, tag, 0), "recv")?;
        if data.len() != len {
            return Err(CommError::Shape { rank: self.rank, what: format!("recv: {} elements sent, {} expected", data.len(), len) });
        }
        Ok(data)
    }
}

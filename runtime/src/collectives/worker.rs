//! A communication thread per rank, so that collectives can run while the rank computes.
//!
//! The thread owns the rank's [`Communicator`] and runs jobs in submission order, which every
//! rank of an SPMD program issues identically, so groups stay matched. [`AsyncComm::submit`]
//! returns at once with a ticket; [`AsyncComm::wait`] blocks until that job is done (jobs
//! finished out of the caller's waiting order are kept until asked for).

use std::any::Any;
use std::collections::{BTreeMap, HashMap};
use std::sync::mpsc::{channel, Receiver, Sender};
use std::thread::JoinHandle;

use super::{CollectiveKind, CommError, Communicator};

type Output = Result<Box<dyn Any + Send>, CommError>;
type Job = Box<dyn FnOnce(&mut Communicator) -> Output + Send>;

/// A rank's communicator, driven by its own thread.
pub struct AsyncComm {
    rank: usize,
    size: usize,
    jobs: Option<Sender<(u64, Job)>>,
    done: Receiver<(u64, Output)>,
    finished: HashMap<u64, Output>,
    next: u64,
    thread: Option<JoinHandle<()>>,
}

impl std::fmt::Debug for AsyncComm {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AsyncComm").field("rank", &self.rank).finish_non_exhaustive()
    }
}

impl AsyncComm {
    /// Starts the thread that will own `comm`.
    pub fn start(mut comm: Communicator) -> AsyncComm {
        let (rank, size) = (comm.rank(), comm.size());
        let (jobs, inbox) = channel::<(u64, Job)>();
        let (report, done) = channel();
        let thread = std::thread::Builder::new()
            .name(format!("comm-{rank}"))
            .spawn(move || {
                for (ticket, job) in inbox {
                    if report.send((ticket, job(&mut comm))).is_err() {
                        break;
                    }
                }
            })
            .expect("spawning a communication thread");
        AsyncComm { rank, size, jobs: Some(jobs), done, finished: HashMap::new(), next: 0, thread: Some(thread) }
    }

    /// This rank.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// Ranks in the world.
    pub fn size(&self) -> usize {
        self.size
    }

    /// Queues `job`; returns its ticket.
    pub fn submit<R: Send + 'static>(&mut self, job: impl FnOnce(&mut Communicator) -> Result<R, CommError> + Send + 'static) -> u64 {
        self.next += 1;
        let ticket = self.next;
        let job: Job = Box::new(move |c| job(c).map(|r| Box::new(r) as Box<dyn Any + Send>));
        if let Some(jobs) = &self.jobs {
            // A closed queue means the thread ended; `wait` reports it.
            let _ = jobs.send((ticket, job));
        }
        ticket
    }

    /// Blocks until job `ticket` is done and returns its result.
    pub fn wait<R: 'static>(&mut self, ticket: u64) -> Result<R, CommError> {
        loop {
            if let Some(out) = self.finished.remove(&ticket) {
                return out.and_then(|b| {
                    b.downcast::<R>().map(|b| *b).map_err(|_| CommError::Shape { rank: self.rank, what: "a collective returned another type".into() })
                });
            }
            match self.done.recv() {
                Ok((t, out)) => {
                    self.finished.insert(t, out);
                }
                Err(_) => return Err(CommError::PeerGone { rank: self.rank, peer: self.rank, what: "the communication thread ended".into() }),
            }
        }
    }

    /// Runs `job` and waits for it.
    pub fn call<R: Send + 'static>(&mut self, job: impl FnOnce(&mut Communicator) -> Result<R, CommError> + Send + 'static) -> Result<R, CommError> {
        let ticket = self.submit(job);
        self.wait(ticket)
    }

    /// Bytes this rank has sent, per kind of collective.
    pub fn bytes_sent(&mut self) -> Result<BTreeMap<CollectiveKind, u64>, CommError> {
        self.call(|c| Ok(c.bytes_sent().clone()))
    }
}

impl Drop for AsyncComm {
    fn drop(&mut self) {
        self.jobs.take();
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

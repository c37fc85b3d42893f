//! The transport a ring runs on, and the in-memory ring of threads.

use std::sync::mpsc::{Receiver, Sender, channel};

use crate::error::{Error, Result};
use crate::tensor::Tensor;

/// What a ring needs from its transport: this rank, the number of ranks, and an ordered stream of
/// messages to the next rank and from the previous one.
pub trait RingComm {
    /// This rank, in `0..ranks()`.
    fn rank(&self) -> usize;
    /// The number of ranks.
    fn ranks(&self) -> usize;
    /// Sends `msg` to rank `(rank + 1) % ranks`, without waiting for it to be received.
    fn send_next(&self, msg: Vec<Tensor>) -> Result<()>;
    /// The next message from rank `(rank + ranks − 1) % ranks`, waiting for it.
    fn recv_prev(&self) -> Result<Vec<Tensor>>;
}

/// One endpoint of a ring of in-memory channels (give each to its own thread).
pub struct LocalRing {
    rank: usize,
    ranks: usize,
    to_next: Sender<Vec<Tensor>>,
    from_prev: Receiver<Vec<Tensor>>,
}

impl LocalRing {
    /// The `ranks` endpoints of a new ring, in rank order.
    pub fn new(ranks: usize) -> Result<Vec<LocalRing>> {
        if ranks == 0 {
            return Err(Error::arg("ranks", "at least 1", 0));
        }
        let (senders, receivers): (Vec<_>, Vec<_>) = (0..ranks).map(|_| channel()).unzip();
        // Channel r carries messages into rank r, so rank r sends on channel r + 1.
        let mut receivers: Vec<Option<Receiver<Vec<Tensor>>>> =
            receivers.into_iter().map(Some).collect();
        Ok((0..ranks)
            .map(|rank| LocalRing {
                rank,
                ranks,
                to_next: senders[(rank + 1) % ranks].clone(),
                from_prev: receivers[rank].take().expect("each receiver is taken once"),
            })
            .collect())
    }
}

impl RingComm for LocalRing {
    fn rank(&self) -> usize {
        self.rank
    }

    fn ranks(&self) -> usize {
        self.ranks
    }

    fn send_next(&self, msg: Vec<Tensor>) -> Result<()> {
        self.to_next
            .send(msg)
            .map_err(|_| Error::Comm(format!("rank {}: the next rank has stopped", self.rank)))
    }

    fn recv_prev(&self) -> Result<Vec<Tensor>> {
        self.from_prev
            .recv()
            .map_err(|_| Error::Comm(format!("rank {}: the previous rank has stopped", self.rank)))
    }
}

//! The ring on threads: every rank of a [`LocalRing`] on a thread of its own, over zigzag shards
//! of whole tensors, the results gathered.

use crate::error::{Error, Result};
use crate::outputs::{ForwardOutput, Gradients};
use crate::params::AttentionParams;
use crate::tensor::Tensor;

use super::comm::{LocalRing, RingComm};
use super::rank::{ring_backward, ring_forward};
use super::shard::{zigzag_gather, zigzag_shard};

/// Runs `each` for every rank on its own thread with its endpoint of a new ring; the results in
/// rank order, or the first error that is not a stopped peer's echo (a rank that fails stops its
/// neighbours too).
fn on_threads<T: Send>(
    ranks: usize,
    each: impl Fn(&LocalRing) -> Result<T> + Sync,
) -> Result<Vec<T>> {
    let comms = LocalRing::new(ranks)?;
    let results: Vec<Result<T>> = std::thread::scope(|scope| {
        let handles: Vec<_> = comms
            .into_iter()
            .map(|comm| {
                let each = &each;
                scope.spawn(move || each(&comm))
            })
            .collect();
        handles
            .into_iter()
            .map(|h| {
                h.join()
                    .unwrap_or_else(|_| Err(Error::Comm("a rank's thread panicked".into())))
            })
            .collect()
    });
    let (mut out, mut echo) = (Vec::with_capacity(ranks), None);
    for r in results {
        match r {
            Ok(t) => out.push(t),
            Err(e @ Error::Comm(_)) => {
                echo.get_or_insert(e);
            }
            Err(e) => return Err(e),
        }
    }
    echo.map_or(Ok(out), Err)
}

/// Shards of `x` along `dim` for every rank.
fn shards(x: &Tensor, dim: usize, ranks: usize) -> Result<Vec<Tensor>> {
    (0..ranks).map(|r| zigzag_shard(x, dim, ranks, r)).collect()
}

/// [`forward`](crate::forward) of whole `[batch, seqlen, heads, dim]` tensors by a ring of
/// `ranks` threads: q, k, v sharded zigzag (seqlen a multiple of 2·`ranks`, the same for q and
/// k), [`ring_forward`] on each, out and lse gathered. Options as [`ring_forward`]'s.
pub fn simulate_forward(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    params: &AttentionParams,
    ranks: usize,
) -> Result<ForwardOutput> {
    let (qs, ks, vs) = (
        shards(q, 1, ranks)?,
        shards(k, 1, ranks)?,
        shards(v, 1, ranks)?,
    );
    let parts = on_threads(ranks, |comm| {
        let r = comm.rank();
        ring_forward(comm, &qs[r], &ks[r], &vs[r], params)
    })?;
    let (outs, lses): (Vec<Tensor>, Vec<Tensor>) =
        parts.into_iter().map(|p| (p.out, p.lse)).unzip();
    Ok(ForwardOutput {
        out: zigzag_gather(&outs, 1)?,
        lse: zigzag_gather(&lses, 2)?,
    })
}

/// [`backward`](crate::backward) of whole tensors by a ring of `ranks` threads (see
/// [`simulate_forward`]): every input sharded, [`ring_backward`] on each, the gradients gathered.
#[allow(clippy::too_many_arguments)]
pub fn simulate_backward(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    out: &Tensor,
    lse: &Tensor,
    dout: &Tensor,
    params: &AttentionParams,
    ranks: usize,
) -> Result<Gradients> {
    let (qs, ks, vs) = (
        shards(q, 1, ranks)?,
        shards(k, 1, ranks)?,
        shards(v, 1, ranks)?,
    );
    let (os, ls, ds) = (
        shards(out, 1, ranks)?,
        shards(lse, 2, ranks)?,
        shards(dout, 1, ranks)?,
    );
    let grads = on_threads(ranks, |comm| {
        let r = comm.rank();
        ring_backward(comm, &qs[r], &ks[r], &vs[r], &os[r], &ls[r], &ds[r], params)
    })?;
    let gather = |f: fn(&Gradients) -> &Tensor| {
        zigzag_gather(&grads.iter().map(|g| f(g).clone()).collect::<Vec<_>>(), 1)
    };
    Ok(Gradients {
        dq: gather(|g| &g.dq)?,
        dk: gather(|g| &g.dk)?,
        dv: gather(|g| &g.dv)?,
        dbias: None,
        drel_bias: None,
    })
}

//! One rank's part of the ring: its queries against each block as it passes.

use crate::attention::{backward, forward};
use crate::error::{Error, Result};
use crate::outputs::{ForwardOutput, Gradients};
use crate::params::AttentionParams;
use crate::tensor::Tensor;

use super::comm::RingComm;
use super::merge::Accumulator;
use super::schedule::Zigzag;
use super::shard::rows;

/// The checks every rank makes: shards `[batch, 2c, heads, dim]` of one length, and options a
/// ring can shard (the ring sets the diagonal itself).
fn layout(comm: &dyn RingComm, q: &Tensor, k: &Tensor, params: &AttentionParams) -> Result<Zigzag> {
    let none = |set: bool, arg: &'static str, why: &str| {
        if set {
            Err(Error::arg(arg, format!("None ({why})"), "a value"))
        } else {
            Ok(())
        }
    };
    none(
        params.bias.is_some(),
        "bias",
        "a ring does not shard an additive bias",
    )?;
    none(
        params.rel_bias.is_some(),
        "rel_bias",
        "a ring does not shard a relative-position table",
    )?;
    none(
        params.varlen.is_some(),
        "varlen",
        "ring shards are padded [batch, seqlen, heads, dim]",
    )?;
    none(
        params.diagonal.is_some(),
        "diagonal",
        "the ring sets each block's diagonal",
    )?;
    if q.rank() != 4 || k.rank() != 4 {
        return Err(Error::arg(
            "q",
            "rank-4 shards [batch, seqlen, heads, dim]",
            format!("{:?}", q.shape()),
        ));
    }
    if k.shape()[1] != q.shape()[1] {
        return Err(Error::arg(
            "k",
            format!("a shard of q's length {}", q.shape()[1]),
            k.shape()[1],
        ));
    }
    if comm.rank() >= comm.ranks() {
        return Err(Error::arg(
            "comm",
            format!("a rank below {}", comm.ranks()),
            comm.rank(),
        ));
    }
    // The shard holds 2 chunks of the 2·ranks of the sequence.
    Zigzag::new(q.shape()[1] * comm.ranks(), comm.ranks(), "q")
}

/// The pairs of (this rank's query chunk, the block's key chunk) that see each other at step
/// `s`: their rows in the shards and their diagonal.
fn pairs(
    z: &Zigzag,
    rank: usize,
    s: usize,
    params: &AttentionParams,
) -> Vec<(usize, usize, AttentionParams)> {
    let mut out = Vec::new();
    for (la, a) in z.chunks(rank).into_iter().enumerate() {
        for (lb, b) in z.chunks(z.source(rank, s)).into_iter().enumerate() {
            if let Some(d) = z.pair(params.window, a, b) {
                out.push((la * z.chunk, lb * z.chunk, params.clone().diagonal(d)));
            }
        }
    }
    out
}

/// This rank's attention output over the whole sequence: `q`, `k`, `v` are its zigzag shards
/// ([`zigzag_shard`](super::zigzag_shard)), `[batch, 2c, heads, dim]` with the sequence of 2c·ranks
/// positions; out `[batch, 2c, heads, dv]` and lse `[batch, heads, 2c]` are its shards of the
/// whole call's. Options: scale, causal and sliding windows, ALiBi, soft cap, GQA/MQA (no bias,
/// rel_bias, varlen or diagonal). Every rank must make the call with the same options; a block
/// is sent on before this rank computes with it. On a GPU each pair runs there and the merge on
/// the host (the results are then uploaded to q's device).
pub fn ring_forward(
    comm: &dyn RingComm,
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    params: &AttentionParams,
) -> Result<ForwardOutput> {
    let z = layout(comm, q, k, params)?;
    let (b, n, h) = (q.shape()[0], q.shape()[1], q.shape()[2]);
    let mut acc = Accumulator::new([b, n, h, v.shape()[3]]);
    let mut block = vec![k.clone(), v.clone()];
    for s in 0..z.ranks {
        if s + 1 < z.ranks {
            comm.send_next(block.clone())?;
        }
        for (qa, kb, p) in pairs(&z, comm.rank(), s, params) {
            let (kc, vc) = (
                rows(&block[0], 1, kb, z.chunk)?,
                rows(&block[1], 1, kb, z.chunk)?,
            );
            acc.add(&forward(&rows(q, 1, qa, z.chunk)?, &kc, &vc, &p)?, qa)?;
        }
        if s + 1 < z.ranks {
            block = received(comm.recv_prev()?, [k, v])?;
        }
    }
    let merged = acc.finish(q.dtype())?;
    Ok(ForwardOutput {
        out: merged.out.to_device(q.device())?,
        lse: merged.lse.to_device(q.device())?,
    })
}

/// This rank's gradients: `q`, `k`, `v`, `dout` its zigzag shards and `out`, `lse` its shards of
/// the forward's result (as [`ring_forward`] returns them). dQ stays with the rank; the dK and dV
/// of a block travel with it and reach its owner after the last step.
#[allow(clippy::too_many_arguments)]
pub fn ring_backward(
    comm: &dyn RingComm,
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    out: &Tensor,
    lse: &Tensor,
    dout: &Tensor,
    params: &AttentionParams,
) -> Result<Gradients> {
    let z = layout(comm, q, k, params)?;
    let c = z.chunk;
    let mut dq = Sum::new(q);
    let mut block = vec![k.clone(), v.clone()];
    let (mut dk, mut dv) = (Sum::new(k), Sum::new(v));
    for s in 0..z.ranks {
        if s + 1 < z.ranks {
            comm.send_next(block.clone())?;
        }
        for (qa, kb, p) in pairs(&z, comm.rank(), s, params) {
            let lse_rows = rows(lse, 2, qa, c)?.contiguous()?;
            let g = backward(
                &rows(q, 1, qa, c)?,
                &rows(&block[0], 1, kb, c)?,
                &rows(&block[1], 1, kb, c)?,
                &rows(out, 1, qa, c)?,
                &lse_rows,
                &rows(dout, 1, qa, c)?,
                &p,
            )?;
            dq.add(&g.dq, qa)?;
            dk.add(&g.dk, kb)?;
            dv.add(&g.dv, kb)?;
        }
        comm.send_next(vec![dk.into_tensor()?, dv.into_tensor()?])?;
        if s + 1 < z.ranks {
            block = received(comm.recv_prev()?, [k, v])?;
        }
        let sums = received(comm.recv_prev()?, [k, v])?;
        (dk, dv) = (Sum::from(&sums[0])?, Sum::from(&sums[1])?);
    }
    Ok(Gradients {
        dq: dq.finish(q)?,
        dk: dk.finish(k)?,
        dv: dv.finish(v)?,
        dbias: None,
        drel_bias: None,
    })
}

/// A message from the previous rank, checked to be two tensors shaped like `like`.
fn received(msg: Vec<Tensor>, like: [&Tensor; 2]) -> Result<Vec<Tensor>> {
    let ok = msg.len() == 2 && msg.iter().zip(like).all(|(m, l)| m.shape() == l.shape());
    if !ok {
        let got: Vec<&[usize]> = msg.iter().map(|m| m.shape()).collect();
        let want: Vec<&[usize]> = like.iter().map(|l| l.shape()).collect();
        return Err(Error::Comm(format!(
            "rank received {got:?}, expected blocks shaped {want:?}"
        )));
    }
    Ok(msg)
}

/// A gradient summed in f32 over the pairs, `[batch, 2c, heads, dim]`.
struct Sum {
    shape: Vec<usize>,
    data: Vec<f32>,
}

impl Sum {
    fn new(like: &Tensor) -> Self {
        Sum {
            shape: like.shape().to_vec(),
            data: vec![0.0; like.numel()],
        }
    }

    fn from(t: &Tensor) -> Result<Self> {
        Ok(Sum {
            shape: t.shape().to_vec(),
            data: t.to_f32_vec()?,
        })
    }

    /// Adds `g` (`[batch, len, heads, dim]`) into rows `start..start + len`.
    fn add(&mut self, g: &Tensor, start: usize) -> Result<()> {
        let (n, row) = (self.shape[1], self.shape[2] * self.shape[3]);
        let len = g.shape()[1];
        for (bi, slab) in g.to_f32_vec()?.chunks(len * row).enumerate() {
            let at = (bi * n + start) * row;
            self.data[at..at + len * row]
                .iter_mut()
                .zip(slab)
                .for_each(|(a, x)| *a += x);
        }
        Ok(())
    }

    /// The sum as an f32 tensor (to send on).
    fn into_tensor(self) -> Result<Tensor> {
        Tensor::from_vec(self.data, &self.shape)
    }

    /// The sum in the dtype and on the device of `like`.
    fn finish(self, like: &Tensor) -> Result<Tensor> {
        self.into_tensor()?
            .to_dtype(like.dtype())?
            .to_device(like.device())
    }
}

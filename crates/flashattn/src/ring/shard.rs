//! Zigzag shards of a tensor along its sequence dimension, and their gathering.

use crate::error::{Error, Result};
use crate::tensor::Tensor;

use super::schedule::Zigzag;

/// Rows `start..start + len` of `x` along dimension `dim`, as a view.
pub(crate) fn rows(x: &Tensor, dim: usize, start: usize, len: usize) -> Result<Tensor> {
    let mut shape = x.shape().to_vec();
    shape[dim] = len;
    x.view(&shape, x.strides(), x.offset() + start * x.strides()[dim])
}

/// `parts` joined along dimension `dim` (shapes equal elsewhere), contiguous, in the first part's
/// dtype, on the CPU.
fn concat(parts: &[Tensor], dim: usize) -> Result<Tensor> {
    let first = &parts[0];
    let outer: usize = first.shape()[..dim].iter().product();
    let mut shape = first.shape().to_vec();
    shape[dim] = parts.iter().map(|p| p.shape()[dim]).sum();
    let data: Vec<Vec<f32>> = parts
        .iter()
        .map(|p| p.to_f32_vec())
        .collect::<Result<_>>()?;
    let mut out = Vec::with_capacity(shape.iter().product());
    for o in 0..outer {
        for d in &data {
            let slab = d.len() / outer;
            out.extend_from_slice(&d[o * slab..(o + 1) * slab]);
        }
    }
    Tensor::from_vec(out, &shape)?.to_dtype(first.dtype())
}

/// Rank `rank`'s zigzag shard of `x` along its sequence dimension `dim` (1 for q, k, v, out and
/// their gradients `[batch, seqlen, heads, dim]`, 2 for an lse `[batch, heads, seqlen]`): with the
/// sequence cut into 2·`ranks` chunks, chunks `rank` and 2·`ranks` − 1 − `rank`, contiguous. The
/// sequence length must be a multiple of 2·`ranks`.
pub fn zigzag_shard(x: &Tensor, dim: usize, ranks: usize, rank: usize) -> Result<Tensor> {
    if dim >= x.rank() {
        return Err(Error::arg(
            "dim",
            format!("a dimension of a rank-{} tensor", x.rank()),
            dim,
        ));
    }
    let z = Zigzag::new(x.shape()[dim], ranks, "x")?;
    if rank >= ranks {
        return Err(Error::arg("rank", format!("below ranks = {ranks}"), rank));
    }
    let [a, b] = z.chunks(rank);
    concat(
        &[
            rows(x, dim, a * z.chunk, z.chunk)?,
            rows(x, dim, b * z.chunk, z.chunk)?,
        ],
        dim,
    )
}

/// The whole tensor from the zigzag shards of every rank (in rank order) along dimension `dim`:
/// the inverse of [`zigzag_shard`].
pub fn zigzag_gather(shards: &[Tensor], dim: usize) -> Result<Tensor> {
    let first = shards
        .first()
        .ok_or_else(|| Error::arg("shards", "one shard a rank", "none"))?;
    if dim >= first.rank() || !first.shape()[dim].is_multiple_of(2) {
        return Err(Error::arg(
            "shards",
            format!("shards with an even length along dimension {dim}"),
            format!("{:?}", first.shape()),
        ));
    }
    if let Some((r, s)) = shards
        .iter()
        .enumerate()
        .find(|(_, s)| s.shape() != first.shape())
    {
        return Err(Error::arg(
            "shards",
            format!("every shard shaped {:?}", first.shape()),
            format!("shard {r}: {:?}", s.shape()),
        ));
    }
    let (ranks, c) = (shards.len(), first.shape()[dim] / 2);
    let z = Zigzag { ranks, chunk: c };
    // Chunk g lives on the rank whose zigzag pair holds it, first or second.
    let chunks: Vec<Tensor> = (0..2 * ranks)
        .map(|g| {
            let r = if g < ranks { g } else { 2 * ranks - 1 - g };
            let at = if z.chunks(r)[0] == g { 0 } else { c };
            rows(&shards[r], dim, at, c)
        })
        .collect::<Result<_>>()?;
    concat(&chunks, dim)
}

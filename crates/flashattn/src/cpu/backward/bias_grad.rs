//! The bias gradient of the CPU backward: `dbias = dS` summed over the bias' broadcast dimensions.
//!
//! Tasks of different (sequence, head, key block) may add into the same element when the bias is
//! broadcast, so additions go through one lock taken once per score tile (never per element):
//! the tile's `dS` is first folded locally over the tile dimensions the bias broadcasts.

use std::ops::Range;
use std::sync::Mutex;

/// The f32 bias gradient being accumulated (shaped like the bias, contiguous).
pub(crate) struct BiasGrad<'a> {
    data: Mutex<&'a mut [f32]>,
    /// Element strides of `[batch, heads, seqlen_q, seqlen_k]`, 0 along broadcast dimensions.
    strides: [usize; 4],
}

/// Per-thread buffer that folds one tile before it is added under the lock.
#[derive(Default)]
pub(crate) struct TileFold {
    sums: Vec<f32>,
}

impl TileFold {
    /// The bytes it holds (its capacity).
    pub(crate) fn bytes(&self) -> usize {
        self.sums.capacity() * size_of::<f32>()
    }
}

impl<'a> BiasGrad<'a> {
    /// The gradient buffer `data` (zeroed) of a contiguous bias of shape `shape`.
    pub(crate) fn new(data: &'a mut [f32], shape: &[usize]) -> Self {
        let pick = |d: usize, stride: usize| if shape[d] == 1 { 0 } else { stride };
        let strides = [
            pick(0, shape[1] * shape[2] * shape[3]),
            pick(1, shape[2] * shape[3]),
            pick(2, shape[3]),
            pick(3, 1),
        ];
        BiasGrad {
            data: Mutex::new(data),
            strides,
        }
    }

    /// Adds the `rows × keys` tile `ds` (row-major with row stride `ld`) of sequence `b`, query
    /// head `h` (rows and keys are positions within the sequence).
    pub(crate) fn add_tile(
        &self,
        fold: &mut TileFold,
        (ds, ld): (&[f32], usize),
        b: usize,
        h: usize,
        rows: Range<usize>,
        keys: Range<usize>,
    ) {
        let [_, _, si, sj] = self.strides;
        let nc = keys.len();
        let base = b * self.strides[0] + h * self.strides[1];
        let tile = ds.chunks(ld).take(rows.len()).map(|row| &row[..nc]);
        if si != 0 && sj != 0 {
            // Nothing to fold: the tile's rows go straight into the gradient's (contiguous:
            // `sj` is 1), under the lock (not folded into a buffer and added element by element,
            // which cost a large share of the backward).
            let mut data = self.data.lock().unwrap_or_else(|e| e.into_inner());
            for (i, row) in rows.zip(tile) {
                let at = base + i * si + keys.start;
                data[at..at + nc]
                    .iter_mut()
                    .zip(row)
                    .for_each(|(d, x)| *d += x);
            }
            return;
        }
        // The tile folded over the dimensions the bias broadcasts: `fr × fc` sums.
        let fr = if si == 0 { 1 } else { rows.len() };
        let fc = if sj == 0 { 1 } else { nc };
        fold.sums.clear();
        fold.sums.resize(fr * fc, 0.0);
        for (r, row) in tile.enumerate() {
            let out = &mut fold.sums[(r % fr) * fc..][..fc];
            if fc == 1 {
                out[0] += row.iter().sum::<f32>();
            } else {
                out.iter_mut().zip(row).for_each(|(o, x)| *o += x);
            }
        }
        let mut data = self.data.lock().unwrap_or_else(|e| e.into_inner());
        for r in 0..fr {
            let at = base + (rows.start + r) * si + keys.start * sj;
            for (c, x) in fold.sums[r * fc..(r + 1) * fc].iter().enumerate() {
                data[at + c * sj] += x;
            }
        }
    }
}

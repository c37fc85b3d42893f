//! AVX-512F kernels of the panel product: one 16-lane accumulator per row of C and panel, so a
//! register block of `R` rows on `W` panels (1 or 2) holds `R·W` accumulators and each
//! broadcast of A feeds `W` FMAs. Three addressings of A share the store:
//!
//! * rows contiguous (`a_cs == 1`, K in `Sᵀ = K·Qᵀ`): rows `4g + j` are read at
//!   `base[g] + j·a_rs`, four rows to a pointer, the rest carried by the address modes;
//! * columns contiguous (`a_rs == 1`, Vᵀ in `Oᵀ += Vᵀ·Pᵀ`): the `R` values of step `l` sit
//!   side by side, one pointer;
//! * any strides (the same kernel as the columns' with the row stride read at run time; for
//!   the last rows of a rows-contiguous product, and no other caller today).
//!
//! [`product_exp`] runs the first block of a columns-contiguous product with the softmax's
//! exponentials of B computed inside its loop (see `softmax_product`); there each FMA takes its
//! own broadcast of A as a memory operand (see [`opaque`]).
//!
//! The columns-contiguous kernels fetch into L1 the values of A 16 steps ahead, the rows
//! kernels their next block's rows of A (see [`fetch_step`]).

use std::arch::x86_64::*;

use super::{Block, ColMax, GradRows, PANEL};
use crate::cpu::simd::exp::avx512::exp2_ps;

/// A run of `blocks` register blocks of the same height, one after the other; C, A and B
/// point at the first block's first row.
type Kernel<const W: usize> = unsafe fn(Block, usize, &mut [ColMax; W]);

/// Lists the instances of a kernel for the row counts given.
macro_rules! kernels {
    ($f:ident, $w:ident, $unit:literal, $grad:tt, [$($r:literal),*]) => {
        [$($f::<$r, $w, $unit, { $grad }> as Kernel<$w>),*]
    };
}

/// Writes (or adds) a block's accumulators `acc` (`R × W`) to C and folds them into each
/// panel's lane maxima (left as they were by the gradient's store). A macro, not a function: a call would put the accumulators in memory.
/// Expanded only inside `unsafe` blocks of AVX-512F functions whose C rows are writable.
macro_rules! store {
    ($x:expr, $acc:expr, $col_max:expr, $grad:expr) => {{
        // The gradient's operands (read only by the kernels with `GRAD` set).
        let g = $x.grad.unwrap_or(GradRows {
            p: std::ptr::null(),
            delta: std::ptr::null(),
        });
        for (w, col_max) in $col_max.iter_mut().enumerate() {
            let mut max = _mm512_loadu_ps(col_max.as_ptr());
            for (r, acc) in $acc.iter().enumerate() {
                let at = w * $x.pair.c + r * $x.st.c_rs;
                let cr = $x.c.add(at);
                let v = if $grad {
                    let d = _mm512_set1_ps(*g.delta.add(r));
                    _mm512_mul_ps(_mm512_loadu_ps(g.p.add(at)), _mm512_sub_ps(acc[w], d))
                } else if $x.accumulate {
                    _mm512_add_ps(acc[w], _mm512_loadu_ps(cr))
                } else {
                    acc[w]
                };
                _mm512_storeu_ps(cr, v);
                // The gradient's callers want no maxima.
                if !$grad {
                    max = _mm512_max_ps(max, v);
                }
            }
            _mm512_storeu_ps(col_max.as_mut_ptr(), max);
        }
    }};
}

/// See [`super::PanelKernels::product`]: [`product`] on one panel or a pair.
///
/// # Safety
/// As for [`product`], on `col_max.len()` panels (1 or 2).
#[target_feature(enable = "avx512f")]
pub(crate) unsafe fn product_any(x: Block, rows: usize, col_max: &mut [ColMax]) {
    let panels = "a product takes one panel or two";
    // SAFETY: the caller's contract.
    unsafe {
        match col_max.len() {
            1 => product::<1>(x, rows, col_max.try_into().expect(panels)),
            _ => product::<2>(x, rows, col_max.try_into().expect(panels)),
        }
    }
}

/// See [`super::PanelKernels::product_exp`]: [`product_exp`] on one panel or a pair.
///
/// # Safety
/// As for [`product_exp`], on `sums.len()` panels (1 or 2), `shift` holding as many.
#[target_feature(enable = "avx512f")]
pub(crate) unsafe fn product_exp_any(x: Block, rows: usize, shift: &[ColMax], sums: &mut [ColMax]) {
    let panels = "a product takes one panel or two, a shift each";
    // SAFETY: the caller's contract.
    unsafe {
        match sums.len() {
            1 => product_exp::<1>(
                x,
                rows,
                shift.try_into().expect(panels),
                sums.try_into().expect(panels),
            ),
            _ => product_exp::<2>(
                x,
                rows,
                shift.try_into().expect(panels),
                sums.try_into().expect(panels),
            ),
        }
    }
}

/// The whole product (see [`super::product`]), cut into register blocks of nearly equal size.
///
/// # Safety
/// AVX-512F must be available and the operands of `x` valid for `rows` rows on `W` panels
/// (checked by [`super::product`]).
#[target_feature(enable = "avx512f")]
unsafe fn product<const W: usize>(x: Block, rows: usize, col_max: &mut [ColMax; W]) {
    // SAFETY: the caller's contract.
    unsafe {
        match x.grad {
            None => product_with::<W, false>(x, rows, col_max),
            Some(_) => product_with::<W, true>(x, rows, col_max),
        }
    }
}

/// [`product`] by the kernels that store the softmax gradient (`GRAD`) or plainly: each
/// kernel is compiled for one kind of store, so that the plain one stays as it was.
///
/// # Safety
/// As for [`product`]; with the gradient, A's columns are not contiguous (`a_rs != 1`).
#[target_feature(enable = "avx512f")]
unsafe fn product_with<const W: usize, const GRAD: bool>(
    x: Block,
    rows: usize,
    col_max: &mut [ColMax; W],
) {
    let cols: [Kernel<W>; 24] = kernels!(
        block_cols,
        W,
        true,
        false,
        [
            1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24
        ]
    );
    let any: [Kernel<W>; 12] = kernels!(
        block_cols,
        W,
        false,
        GRAD,
        [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12]
    );
    let quads: [Kernel<W>; 6] = [
        block_rows::<4, 1, W, GRAD>,
        block_rows::<8, 2, W, GRAD>,
        block_rows::<12, 3, W, GRAD>,
        block_rows::<16, 4, W, GRAD>,
        block_rows::<20, 5, W, GRAD>,
        block_rows::<24, 6, W, GRAD>,
    ];
    // 24 accumulators at most: 24 rows on one panel, 12 on a pair.
    let max_rows = 24 / W;
    let st = x.st;
    let mut r0 = 0;
    // Runs `blocks` blocks of `mr` rows with `table[mr / unit - 1]`.
    let mut run = |table: &[Kernel<W>], unit: usize, (blocks, mr): (usize, usize)| {
        if blocks == 0 || mr == 0 {
            return;
        }
        let kernel = table[mr / unit - 1];
        // Rows r0.. lie inside C and A (the caller's contract).
        let first = x.down(r0);
        // SAFETY: rows r0..r0 + blocks·mr lie inside the product's rows; AVX-512F is available.
        unsafe { kernel(first, blocks, col_max) };
        r0 += blocks * mr;
    };
    if st.a_rs == 1 {
        assert!(
            !GRAD,
            "panel product: no gradient with A's columns contiguous"
        );
        for part in even_split(rows, max_rows) {
            run(&cols, 1, part);
        }
    } else if st.a_cs == 1 {
        for (blocks, quads_in_block) in even_split(rows / 4, max_rows / 4) {
            run(&quads, 4, (blocks, 4 * quads_in_block));
        }
        run(&any, 1, (1, rows % 4));
    } else {
        for part in even_split(rows, 12) {
            run(&any, 1, part);
        }
    }
}

/// [`super::softmax_product::product_exp`] for columns contiguous in A (`a_rs == 1`): the first
/// block of rows (at most 8 on a pair, 12 on one panel, leaving registers for the exp) turns
/// each row of B into `2^(B − shift)` as it goes; the other blocks read the stored result.
///
/// # Safety
/// As for [`product`], with `a_rs == 1`, B writable through `x.b` and `st.b_rs == 16`.
#[target_feature(enable = "avx512f")]
unsafe fn product_exp<const W: usize>(
    x: Block,
    rows: usize,
    shift: &[ColMax; W],
    sums: &mut [ColMax; W],
) {
    type ExpKernel<const W: usize> = unsafe fn(Block, &[ColMax; W], &mut [ColMax; W]);
    let first: [ExpKernel<W>; 12] = [
        block_exp::<1, W>,
        block_exp::<2, W>,
        block_exp::<3, W>,
        block_exp::<4, W>,
        block_exp::<5, W>,
        block_exp::<6, W>,
        block_exp::<7, W>,
        block_exp::<8, W>,
        block_exp::<9, W>,
        block_exp::<10, W>,
        block_exp::<11, W>,
        block_exp::<12, W>,
    ];
    let height = rows.min(if W == 2 { 8 } else { 12 });
    // SAFETY: rows 0..height lie inside the product (the caller's contract).
    unsafe { first[height - 1](x, shift, sums) };
    let rest = x.down(height);
    // Their maxima are not wanted (C accumulates the output).
    let mut col_max = [[f32::NEG_INFINITY; PANEL]; W];
    // SAFETY: rows height..rows of the same product; B now holds the exponentials.
    unsafe { product(rest, rows - height, &mut col_max) };
}

/// One block of `R` rows of [`block_cols`] (unit row stride) whose step `l` first replaces row
/// `l` of each panel of B by `2^(B − shift)` and adds it to the panel's lane sums.
///
/// # Safety
/// As for [`block_cols`], with B's rows writable.
#[inline]
#[target_feature(enable = "avx512f")]
unsafe fn block_exp<const R: usize, const W: usize>(
    x: Block,
    shift: &[ColMax; W],
    sums: &mut [ColMax; W],
) {
    let mut acc = [[_mm512_setzero_ps(); W]; R];
    // SAFETY: `shift` and `sums` hold W panels of 16 f32.
    let s: [__m512; W] = std::array::from_fn(|w| unsafe { _mm512_loadu_ps(shift[w].as_ptr()) });
    let mut sum = [_mm512_setzero_ps(); W];
    // Row `l` of each panel replaced by its probabilities, which are added to the sums.
    let b = x.b.cast_mut();
    let probs = |l: usize, sum: &mut [__m512; W]| {
        for (w, sum) in sum.iter_mut().enumerate() {
            // SAFETY: row l < k of panel w is valid and writable (caller's contract).
            unsafe {
                let at = b.add(l * x.st.b_rs + w * x.pair.b);
                let p = exp2_ps::<false>(_mm512_sub_ps(_mm512_loadu_ps(at), s[w]));
                _mm512_storeu_ps(at, p);
                *sum = _mm512_add_ps(*sum, p);
            }
        }
    };
    // Software-pipelined: row l + AHEAD is exponentiated while row l is multiplied, so the
    // exponentials' long dependency chains do not hold up the FMAs.
    const AHEAD: usize = 8;
    for l in 0..AHEAD.min(x.k) {
        probs(l, &mut sum);
    }
    let mut al = x.a;
    for l in 0..x.k {
        if l + AHEAD < x.k {
            probs(l + AHEAD, &mut sum);
        }
        fetch_step::<R>(al, x.st.a_cs);
        // SAFETY: step l's R values of A and row l of B are valid (caller's contract).
        unsafe {
            let bv = load_panels::<W>(b.add(l * x.st.b_rs), x.pair.b);
            // Each panel reads A through a pointer of its own, so that each FMA takes its
            // broadcast as a memory operand instead of sharing one `vbroadcastss` (see
            // `opaque`).
            let a: [*const f32; W] = std::array::from_fn(|w| if w == 0 { al } else { opaque(al) });
            for (r, acc) in acc.iter_mut().enumerate() {
                for (w, acc) in acc.iter_mut().enumerate() {
                    *acc = _mm512_fmadd_ps(_mm512_set1_ps(*a[w].add(r)), bv[w], *acc);
                }
            }
            al = al.add(x.st.a_cs);
        }
    }
    let mut col_max = [[f32::NEG_INFINITY; PANEL]; W];
    // SAFETY: the block's rows of C are writable (caller's contract).
    unsafe { store!(x, acc, col_max, false) };
    for (w, total) in sums.iter_mut().enumerate() {
        // SAFETY: `total` holds 16 f32.
        unsafe {
            let t = _mm512_add_ps(_mm512_loadu_ps(total.as_ptr()), sum[w]);
            _mm512_storeu_ps(total.as_mut_ptr(), t);
        }
    }
}

/// `p`, which the optimizer can no longer tell equal to `p` (nor derive from another pointer:
/// see [`block_rows`]). Two panels' loads of the same A value through different pointers are
/// then not merged into one `vbroadcastss` feeding two FMAs; each stays a broadcast memory
/// operand of its FMA (`vfmadd231ps zmm, zmm, m32{1to16}`).
///
/// That pays in [`block_exp`] only, whose exponentials keep the vector pipes beside the FMA
/// ones busy, where a separate `vbroadcastss zmm` also costs about half a cycle. The plain
/// blocks' FMAs alone set their pace, so they keep the shared broadcast (see BENCHMARKS.md).
#[inline(always)]
#[allow(
    clippy::pointers_in_nomem_asm_block,
    reason = "the asm reads nothing through `p`"
)]
fn opaque(mut p: *const f32) -> *const f32 {
    // SAFETY: the template is empty: no instruction, `p` stays in its register.
    unsafe {
        std::arch::asm!("/* {0} */", inout(reg) p, options(pure, nomem, nostack, preserves_flags))
    };
    p
}

/// `n` cut into the fewest blocks of at most `max`, heights differing by at most one: the
/// taller blocks first, as (blocks, height) pairs (a pair may have no blocks).
fn even_split(n: usize, max: usize) -> [(usize, usize); 2] {
    let parts = n.div_ceil(max);
    if parts == 0 {
        return [(0, 1); 2];
    }
    let short = n / parts;
    [(n % parts, short + 1), (parts - n % parts, short.max(1))]
}

/// Rows contiguous in A (`a_cs == 1`): `R = 4·G` rows, `G` pointers.
///
/// # Safety
/// AVX-512F must be available; `a + r·a_rs + l` (r < R, l < k), `b + w·pair.b + l·b_rs ..+16`
/// and `c + w·pair.c + r·c_rs ..+16` (w < W) must be valid, C writable and not overlapping A,
/// B or itself.
#[inline]
#[target_feature(enable = "avx512f")]
unsafe fn block_rows<const R: usize, const G: usize, const W: usize, const GRAD: bool>(
    mut x: Block,
    blocks: usize,
    col_max: &mut [ColMax; W],
) {
    for _ in 0..blocks {
        let mut acc = [[_mm512_setzero_ps(); W]; R];
        let s1 = x.st.a_rs * size_of::<f32>();
        let s3 = 3 * s1;
        let mut base = [x.a.cast::<u8>(); G];
        for (g, p) in base.iter_mut().enumerate() {
            // SAFETY: row 4g < R of A is valid (caller's contract).
            *p = unsafe { x.a.add(4 * g * x.st.a_rs).cast::<u8>() };
        }
        let mut bl = x.b;
        // The next block's rows of A (K rows in `Sᵀ = K·Qᵀ`) fetched into L1, one line a step:
        // row `l % R`, line `l / R` (about 1% on top of `fetch_step`; see BENCHMARKS.md). The
        // steps go in runs of R, one line of the R rows a run: computed per step, the division,
        // remainder and branches took more than the issue slots that two FMA pipes leave.
        let next = x.a.wrapping_add(R * x.st.a_rs);
        let mut l0 = 0;
        while l0 < x.k {
            let steps = R.min(x.k - l0);
            // Past the row's last line, the last line again (a prefetch of what is in L1).
            let mut fetch = next.wrapping_add((l0 / R * LINE_FLOATS).min(x.k - 1));
            for _ in 0..steps {
                _mm_prefetch::<_MM_HINT_T0>(fetch.cast());
                fetch = fetch.wrapping_add(x.st.a_rs);
                // SAFETY: the current column of the block's rows of A and row of B are valid.
                unsafe {
                    let bv = load_panels::<W>(bl, x.pair.b);
                    for (g, p) in base.iter_mut().enumerate() {
                        let q = *p;
                        let row = [q, q.add(s1), q.add(2 * s1), q.add(s3)];
                        for (j, at) in row.into_iter().enumerate() {
                            let xv = _mm512_set1_ps(*at.cast::<f32>());
                            for w in 0..W {
                                acc[4 * g + j][w] = _mm512_fmadd_ps(xv, bv[w], acc[4 * g + j][w]);
                            }
                        }
                        // Opaque: otherwise the groups' pointers become one induction
                        // variable, and each step rebuilds the others from it.
                        *p = opaque(q.add(size_of::<f32>()).cast()).cast();
                    }
                    bl = bl.add(x.st.b_rs);
                }
            }
            l0 += steps;
        }
        // SAFETY: the block's rows of C are writable (caller's contract); `col_max` holds W
        // panels of 16 f32.
        unsafe { store!(x, acc, col_max, GRAD) };
        // The next block (wrapping: past the last block these point nowhere and are not read).
        x = x.down(R);
    }
}

/// Step `l` reads `a + l·a_cs + r·a_rs`, r < R: columns contiguous in A (`a_rs == 1`, told
/// by `UNIT` so that the offsets are constants), or any strides.
///
/// # Safety
/// As for [`block_rows`], with `a + r·a_rs + l·a_cs` valid instead.
#[inline]
#[target_feature(enable = "avx512f")]
unsafe fn block_cols<const R: usize, const W: usize, const UNIT: bool, const GRAD: bool>(
    mut x: Block,
    blocks: usize,
    col_max: &mut [ColMax; W],
) {
    let a_rs = if UNIT { 1 } else { x.st.a_rs };
    for _ in 0..blocks {
        let mut acc = [[_mm512_setzero_ps(); W]; R];
        let (mut al, mut bl) = (x.a, x.b);
        for _ in 0..x.k {
            if UNIT {
                fetch_step::<R>(al, x.st.a_cs);
            }
            // SAFETY: step l's R values of A and row l of B are valid (caller's contract).
            unsafe {
                let bv = load_panels::<W>(bl, x.pair.b);
                for (r, acc) in acc.iter_mut().enumerate() {
                    let xv = _mm512_set1_ps(*al.add(r * a_rs));
                    for w in 0..W {
                        acc[w] = _mm512_fmadd_ps(xv, bv[w], acc[w]);
                    }
                }
                al = al.add(x.st.a_cs);
                bl = bl.add(x.st.b_rs);
            }
        }
        // SAFETY: the block's rows of C are writable (caller's contract); `col_max` holds W
        // panels of 16 f32.
        unsafe { store!(x, acc, col_max, GRAD) };
        // The next block (wrapping: past the last block these point nowhere and are not read).
        x = x.down(R);
    }
}

/// Floats in a cache line.
const LINE_FLOATS: usize = crate::cpu::prefetch::LINE / size_of::<f32>();

/// Steps ahead that the columns-contiguous kernels fetch their values of A into L1.
const FETCH_AHEAD: usize = 16;

/// Fetches into L1 the `R` values of A that the step [`FETCH_AHEAD`] steps after the one at
/// `al` reads (both ends: they may straddle two lines). A prefetch never faults, so past the
/// last step it costs only the fetch.
///
/// In `Oᵀ += Vᵀ·Pᵀ` with V rows 2 KiB apart (`[B, N, H, D]`, H·D = 512), each step's values
/// come from L2: the rows' lines fall into 2 of the L1's 64 sets. The FMAs that wait on them
/// fill the FP scheduler, so the loads of the next steps issue late; a prefetch goes through
/// the load unit alone (1–2% of the forward; 8, 12 and 16 steps ahead alike; see
/// BENCHMARKS.md).
#[inline]
#[target_feature(enable = "avx512f")]
fn fetch_step<const R: usize>(al: *const f32, a_cs: usize) {
    let at = al.wrapping_add(FETCH_AHEAD * a_cs);
    _mm_prefetch::<_MM_HINT_T0>(at.cast());
    _mm_prefetch::<_MM_HINT_T0>(at.wrapping_add(R - 1).cast());
}

/// Row `l` of each of the `W` panels of B, `b` pointing at the first.
///
/// # Safety
/// AVX-512F must be available; `b + w·pair_b .. + 16` (w < W) must be readable.
#[inline]
#[target_feature(enable = "avx512f")]
unsafe fn load_panels<const W: usize>(b: *const f32, pair_b: usize) -> [__m512; W] {
    // SAFETY: the caller's contract.
    std::array::from_fn(|w| unsafe { _mm512_loadu_ps(b.add(w * pair_b)) })
}

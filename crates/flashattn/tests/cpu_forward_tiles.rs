//! The CPU forward at the edges of its tiles, against the f64 oracle: lengths around the query
//! block (64), the query panel (16) and the key block (256), head dims from 1 to 512 (where the
//! key block shrinks), every mask crossing tile boundaries, GQA, dtypes, and the per-element
//! options on the masked tiles. Seeds are fixed and printed; bounds are those of
//! `common::check_forward_cases` (f32 ≤ 1e-5 relative, f16/bf16 within 2× the standard attention).

mod common;

use common::{Alibi, Case, Layout, check_forward_cases};
use flashattn::DType;

const SEQLENS: [usize; 7] = [1, 7, 63, 64, 65, 113, 203];
const HEAD_DIMS: [usize; 4] = [1, 8, 80, 512];
const DTYPES: [DType; 3] = [DType::F32, DType::F16, DType::BF16];

/// Every awkward length against every head dim, with the masks, GQA ratios and dtypes in turn.
#[test]
fn awkward_sizes() {
    let masks: [fn(Case) -> Case; 4] = [
        |c| c,
        |c| c.causal(),
        |c| c.window(Some(17), Some(3)),
        |c| c.window(Some(0), Some(40)),
    ];
    let gqa = [(1, 1), (4, 2), (3, 1)];
    let mut cases = Vec::new();
    for (n, &nq) in SEQLENS.iter().enumerate() {
        for (m, &d) in HEAD_DIMS.iter().enumerate() {
            let nk = SEQLENS[(n + m) % SEQLENS.len()];
            let (h, hk) = gqa[(n + m) % gqa.len()];
            let case = Case::new(nq, nk, d)
                .heads(h, hk)
                .dtype(DTYPES[(n + 2 * m) % 3]);
            cases.push(masks[(n + m) % masks.len()](case));
        }
    }
    check_forward_cases("awkward_sizes", 50_000, &cases);
}

/// Lengths that cross several key blocks (256 keys at D=64), causal and windowed, with the
/// per-element options on the blocks that cross the mask boundary; f32 K/V read in place and
/// copied per block.
#[test]
fn across_key_blocks() {
    let cases = vec![
        Case::new(257, 257, 64),
        Case::new(300, 600, 64).causal(),
        Case::new(600, 300, 64).causal().dtype(DType::BF16),
        Case::new(520, 520, 64).window(Some(100), Some(30)),
        Case::new(513, 513, 32).window(Some(0), Some(0)).heads(2, 1),
        Case::new(400, 400, 64)
            .causal()
            .softcap(5.0)
            .alibi(Alibi::PerHead)
            .bias([false, true, true, true])
            .heads(4, 2),
        Case::new(333, 401, 96)
            .dv(40)
            .window(Some(50), Some(50))
            .bias([false, false, true, false])
            .layout(Layout::Bhnd),
        Case::new(290, 290, 128)
            .causal()
            .dtype(DType::F16)
            .layout(Layout::Bhnd),
        // K/V rows 16·64 f32 = 4 KiB apart: f32 key blocks are copied, not read in place, and
        // (with up to 5 threads) tasks take 512 queries, so the second case crosses one.
        Case::new(270, 300, 64).heads(16, 16).causal(),
        Case::new(700, 650, 64)
            .heads(16, 8)
            .window(Some(300), Some(20)),
        // f16/bf16 key rows are converted once per thread and head (kept from task to task),
        // and these tasks also take 512 queries.
        Case::new(600, 640, 64)
            .heads(8, 8)
            .causal()
            .dtype(DType::BF16),
        Case::new(0, 0, 16).varlen(&[(130, 300), (0, 5), (70, 0), (257, 257)]),
        Case::new(0, 0, 64)
            .varlen(&[(200, 260), (1, 1), (65, 64)])
            .causal()
            .heads(4, 1),
    ];
    check_forward_cases("across_key_blocks", 60_000, &cases);
}

/// Converted or copied key rows are kept by each thread from one task to its next on the same
/// head: the same shapes again with fresh inputs (a new call must not read the last call's
/// rows), GQA (query heads sharing a kept head), windows whose tasks start at different keys,
/// several sequences, and heads too long to keep (over 2 MiB of K and V: copied per block).
#[test]
fn kept_key_rows_belong_to_their_call_and_head() {
    let same = Case::new(300, 300, 64)
        .heads(2, 1)
        .causal()
        .dtype(DType::BF16);
    let cases = vec![
        same.clone(),
        same.clone(),
        same.window(Some(40), Some(8)),
        Case::new(260, 270, 64)
            .heads(16, 16)
            .window(Some(90), Some(0)),
        Case::new(260, 270, 64)
            .heads(16, 16)
            .window(Some(90), Some(0)),
        Case::new(0, 0, 32)
            .varlen(&[(150, 200), (0, 7), (140, 140), (300, 90)])
            .heads(2, 1)
            .causal()
            .dtype(DType::F16),
        Case::new(70, 600, 512).causal().dtype(DType::BF16),
        Case::new(40, 1100, 256).heads(2, 1).dtype(DType::F16),
    ];
    check_forward_cases("kept_key_rows", 70_000, &cases);
}

use super::*;
use crate::cpu::simd::exp::shift_rounding;

/// A, B (`W` panels, rows a little wider than 16), the strides and the panels' offsets of a
/// `rows × k` product whose A has strides `(a_rs, a_cs)` and whose C rows are 17 apart.
fn operands<const W: usize>(
    rows: usize,
    k: usize,
    (a_rs, a_cs): (usize, usize),
) -> (Vec<f32>, Vec<f32>, PanelStrides, PairOffsets) {
    let (b_rs, c_rs) = (PANEL + 2, PANEL + 1);
    let pair = PairOffsets {
        b: b_rs * k.max(1) + 5,
        c: c_rs * rows.max(1) + 3,
    };
    let a: Vec<f32> = (0..(rows.max(1) - 1) * a_rs + k.max(1) * a_cs + 1)
        .map(|i| (i as f32 * 0.37).sin())
        .collect();
    let b: Vec<f32> = (0..pair.b * W).map(|i| (i as f32 * 0.11).cos()).collect();
    let st = PanelStrides {
        a_rs,
        a_cs,
        b_rs,
        c_rs,
    };
    (a, b, st, pair)
}

/// Checks one product against f64 sums, on `W` panels, for every level.
fn check<const W: usize>(rows: usize, k: usize, a_rs: usize, a_cs: usize) {
    let (a, b, st, pair) = operands::<W>(rows, k, (a_rs, a_cs));
    let (b_rs, c_rs) = (st.b_rs, st.c_rs);
    for simd in Simd::available() {
        for write in [Write::Overwrite, Write::Accumulate] {
            let init = if write == Write::Overwrite {
                f32::NAN
            } else {
                1.0
            };
            let mut c = vec![init; pair.c * W];
            let col_max = product::<W>(simd, &mut c, &a, &b, rows, k, st, pair, write);
            for w in 0..W {
                for j in 0..PANEL {
                    let column = (0..rows).map(|r| c[w * pair.c + r * c_rs + j]);
                    let want = column.fold(f32::NEG_INFINITY, f32::max);
                    assert_eq!(col_max[w][j], want, "{simd} max of panel {w} lane {j}");
                }
                for r in 0..rows {
                    for j in 0..PANEL {
                        let want: f64 = (0..k)
                            .map(|l| {
                                a[r * a_rs + l * a_cs] as f64 * b[w * pair.b + l * b_rs + j] as f64
                            })
                            .sum::<f64>()
                            + if write == Write::Accumulate { 1.0 } else { 0.0 };
                        let got = c[w * pair.c + r * c_rs + j] as f64;
                        assert!(
                            (got - want).abs() < 1e-4,
                            "{simd} W={W} rows {rows} k {k} strides ({a_rs}, {a_cs}) \
                             panel {w} ({r},{j}): {got} vs {want}"
                        );
                    }
                }
                // Nothing outside the rows × 16 of each panel is written.
                for i in 0..pair.c {
                    let (r, j) = (i / c_rs, i % c_rs);
                    let v = c[w * pair.c + i];
                    if r >= rows || j >= PANEL {
                        assert!(v.is_nan() || v == 1.0, "{simd} wrote outside C at {i}");
                    }
                }
            }
        }
    }
}

#[test]
fn matches_f64_for_every_row_count_layout_and_level() {
    let row_counts = (0..=30).chain([47, 64, 256]);
    for rows in row_counts {
        for k in [0, 1, 3, 17, 64] {
            // Rows contiguous (K in Sᵀ = K·Qᵀ), columns contiguous (Vᵀ), any strides.
            for (a_rs, a_cs) in [(k + 3, 1), (1, rows + 3), (2, 2 * rows + 1)] {
                check::<1>(rows, k, a_rs, a_cs);
                check::<2>(rows, k, a_rs, a_cs);
            }
        }
    }
}

#[test]
fn a_pair_equals_its_panels_one_at_a_time() {
    let (rows, k) = (37, 20);
    let st = PanelStrides {
        a_rs: k,
        a_cs: 1,
        b_rs: PANEL,
        c_rs: PANEL,
    };
    let a: Vec<f32> = (0..rows * k).map(|i| (i as f32 * 0.9).sin()).collect();
    let b: Vec<f32> = (0..2 * k * PANEL).map(|i| (i as f32 * 0.3).cos()).collect();
    let pair = PairOffsets {
        b: k * PANEL,
        c: rows * PANEL,
    };
    let mut both = vec![f32::NAN; 2 * rows * PANEL];
    let (pair_, write) = (Some(pair), Write::Overwrite);
    let col_max = panels_product(&mut both, &a, &b, rows, k, st, pair_, write);
    for w in 0..2 {
        let mut one = vec![f32::NAN; rows * PANEL];
        let [alone, none] = panels_product(
            &mut one,
            &a,
            &b[w * pair.b..],
            rows,
            k,
            st,
            None,
            Write::Overwrite,
        );
        assert_eq!(none, [f32::NEG_INFINITY; PANEL]);
        assert_eq!(alone, col_max[w]);
        assert_eq!(one[..], both[w * pair.c..(w + 1) * pair.c]);
    }
}

#[test]
fn side_by_side_panels_match_one_at_a_time() {
    // The backward's layout: C, B `rows × 32` row-major, panel 1 in columns 16..32.
    let (rows, k) = (29, 11);
    let st = PanelStrides {
        a_rs: 1,
        a_cs: rows,
        b_rs: 2 * PANEL,
        c_rs: 2 * PANEL,
    };
    let a: Vec<f32> = (0..rows * k).map(|i| (i as f32 * 0.3).sin()).collect();
    let b: Vec<f32> = (0..k * 2 * PANEL).map(|i| (i as f32 * 0.7).cos()).collect();
    let pair = PairOffsets { b: PANEL, c: PANEL };
    let mut both = vec![0.5; rows * 2 * PANEL];
    let mut one = both.clone();
    panels_product(
        &mut both,
        &a,
        &b,
        rows,
        k,
        st,
        Some(pair),
        Write::Accumulate,
    );
    for w in 0..2 {
        let s = w * PANEL;
        panels_product(
            &mut one[s..],
            &a,
            &b[s..],
            rows,
            k,
            st,
            None,
            Write::Accumulate,
        );
    }
    assert_eq!(both, one);
}

#[test]
#[should_panic(expected = "overlap")]
fn overlapping_pair_panels_are_refused() {
    let st = PanelStrides {
        a_rs: 1,
        a_cs: 4,
        b_rs: PANEL,
        c_rs: PANEL,
    };
    let (a, b) = (vec![1.0; 16], vec![1.0; 4 * PANEL]);
    let mut c = vec![0.0; 8 * PANEL];
    let pair = PairOffsets { b: 0, c: 2 * PANEL };
    panels_product(&mut c, &a, &b, 4, 4, st, Some(pair), Write::Overwrite);
}

/// The fused softmax product against f64, on `W` panels, for every level and for A with unit
/// row stride (the fused AVX-512 kernel) or not (the exp pass, then the product): B becomes
/// `2^(B − shift)`, C gains `A · 2^(B − shift)`, and the lane sums come back.
fn check_softmax<const W: usize>(rows: usize, k: usize, a_rs: usize, a_cs: usize) {
    let c_rs = PANEL + 1;
    let pair = PairOffsets {
        b: PANEL * k.max(1) + 32,
        c: c_rs * rows.max(1) + 3,
    };
    let st = PanelStrides {
        a_rs,
        a_cs,
        b_rs: PANEL,
        c_rs,
    };
    let a: Vec<f32> = (0..(rows.max(1) - 1) * a_rs + k.max(1) * a_cs + 1)
        .map(|i| (i as f32 * 0.37).sin())
        .collect();
    // Scores up to 7 (the shift), some masked, some far below the shift.
    let scores: Vec<f32> = (0..pair.b * W)
        .map(|i| match i % 11 {
            3 => f32::NEG_INFINITY,
            7 => -160.0,
            _ => (i as f32 * 0.23).cos() * 7.0,
        })
        .collect();
    let shift: [ColMax; W] = std::array::from_fn(|w| std::array::from_fn(|l| 7.0 + (w + l) as f32));
    for simd in Simd::available() {
        let mut b = scores.clone();
        let mut c = vec![1.0f32; pair.c * W];
        let sums =
            softmax_product::product_exp::<W>(simd, &mut c, &a, &mut b, rows, k, st, pair, &shift);
        for w in 0..W {
            let p = |l: usize, j: usize| {
                (scores[w * pair.b + l * PANEL + j] as f64 - shift[w][j] as f64).exp2()
            };
            // Each P's error: the exponential's, and the f32 rounding of its argument.
            let rel = |l: usize, j: usize| {
                3e-7 + shift_rounding(scores[w * pair.b + l * PANEL + j], shift[w][j])
            };
            for j in 0..PANEL {
                let want: f64 = (0..k).map(|l| p(l, j)).sum();
                let terms: f64 = (0..k).map(|l| rel(l, j) * p(l, j)).sum();
                let got = sums[w][j] as f64;
                assert!(
                    (got - want).abs() <= terms + 1e-6 * want.max(1e-30),
                    "{simd} sum {got} vs {want}"
                );
                for l in 0..k {
                    let got = b[w * pair.b + l * PANEL + j] as f64;
                    // Results below 2^-126 may flush to 0 (the exp kernels' contract).
                    let tol = rel(l, j) * p(l, j) + f32::MIN_POSITIVE as f64;
                    assert!(
                        (got - p(l, j)).abs() <= tol,
                        "{simd} P {got} vs {}",
                        p(l, j)
                    );
                }
                for r in 0..rows {
                    let want = 1.0
                        + (0..k)
                            .map(|l| a[r * a_rs + l * a_cs] as f64 * p(l, j))
                            .sum::<f64>();
                    let got = c[w * pair.c + r * c_rs + j] as f64;
                    assert!(
                        (got - want).abs() < 1e-5,
                        "{simd} W={W} rows {rows} k {k} ({r},{j}): {got} vs {want}"
                    );
                }
            }
            // B past the panel's k rows and C outside its rows × 16 are untouched.
            let tail = w * pair.b + k * PANEL..(w + 1) * pair.b;
            assert_eq!(b[tail.clone()], scores[tail], "{simd} wrote past B");
            for i in 0..pair.c {
                let (r, j) = (i / c_rs, i % c_rs);
                if r >= rows || j >= PANEL {
                    assert_eq!(c[w * pair.c + i], 1.0, "{simd} wrote outside C at {i}");
                }
            }
        }
    }
}

#[test]
fn softmax_product_matches_f64_for_every_size_and_level() {
    for rows in (1..=26).chain([64, 100]) {
        for k in [0, 1, 3, 9, 17, 64] {
            for (a_rs, a_cs) in [(1, rows + 3), (k + 3, 1)] {
                check_softmax::<1>(rows, k, a_rs, a_cs);
                check_softmax::<2>(rows, k, a_rs, a_cs);
            }
        }
    }
}

/// Checks [`softmax_grad::grad`] against f64 sums on `W` panels, for every level: `C = P∘(A·B −
/// D)`, nothing written outside C's panels.
fn check_grad<const W: usize>(rows: usize, k: usize, a_rs: usize, a_cs: usize) {
    let (a, b, st, pair) = operands::<W>(rows, k, (a_rs, a_cs));
    let (b_rs, c_rs) = (st.b_rs, st.c_rs);
    let p: Vec<f32> = (0..pair.c * W)
        .map(|i| (i as f32 * 0.23).sin().abs())
        .collect();
    let delta: Vec<f32> = (0..rows).map(|r| (r as f32 * 0.7).cos()).collect();
    for simd in Simd::available() {
        let mut c = vec![f32::NAN; pair.c * W];
        softmax_grad::grad::<W>(simd, &mut c, &a, &b, (rows, k), st, pair, (&p, &delta));
        for w in 0..W {
            for i in 0..pair.c {
                let (r, j) = (i / c_rs, i % c_rs);
                let got = c[w * pair.c + i];
                if r >= rows || j >= PANEL {
                    assert!(got.is_nan(), "{simd} wrote outside C at {i}");
                    continue;
                }
                let dp: f64 = (0..k)
                    .map(|l| a[r * a_rs + l * a_cs] as f64 * b[w * pair.b + l * b_rs + j] as f64)
                    .sum();
                let want = p[w * pair.c + i] as f64 * (dp - delta[r] as f64);
                assert!(
                    (got as f64 - want).abs() < 1e-4,
                    "{simd} W={W} rows {rows} k {k} strides ({a_rs}, {a_cs}) panel {w} \
                     ({r},{j}): {got} vs {want}"
                );
            }
        }
    }
}

#[test]
fn softmax_grad_product_matches_f64_for_every_size_and_level() {
    for rows in (0..=30).chain([47, 128]) {
        for k in [0, 1, 17, 64] {
            // Rows contiguous (dO in dP = dO·Vᵀ), columns contiguous, any strides.
            for (a_rs, a_cs) in [(k + 3, 1), (1, rows + 3), (2, 2 * rows + 1)] {
                check_grad::<1>(rows, k, a_rs, a_cs);
                check_grad::<2>(rows, k, a_rs, a_cs);
            }
        }
    }
}

use super::*;

/// Every level this CPU runs, lowest first.
fn levels() -> Vec<Simd> {
    [Simd::Portable, Simd::Avx2, Simd::Avx512]
        .into_iter()
        .filter(|&s| s <= cpu_simd())
        .collect()
}

/// Checks one product against f64 sums, on `W` panels, for every level.
fn check<const W: usize>(rows: usize, k: usize, a_rs: usize, a_cs: usize) {
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
    for simd in levels() {
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
                    let want = (0..rows)
                        .map(|r| c[w * pair.c + r * c_rs + j])
                        .fold(f32::NEG_INFINITY, f32::max);
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
    let maxes = panels_product(&mut both, &a, &b, rows, k, st, Some(pair), Write::Overwrite);
    for w in 0..2 {
        let mut one = vec![f32::NAN; rows * PANEL];
        let [max, none] = panels_product(
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
        assert_eq!(max, maxes[w]);
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

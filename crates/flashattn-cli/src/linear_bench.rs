//! `bench --linear`: linear attention (φ = elu+1, eps 1e-6, the configuration's mask) timed on
//! the same q, k, v as flashattn, and where it overtakes flashattn as the sequences grow.

use flashattn::{Device, Error, LinearParams, Window, linear_backward, linear_forward};

use super::bench::{BACKWARD_FLOP_FACTOR, Outcome, Pass, Row};
use super::inputs::Inputs;
use super::timing::{Measurement, measure};
use super::{CliError, CliResult, device};

/// Linear attention's FLOPs for `pass` on `x`: `2·B·D·Dv·(HK·Nk + H·Nq)` a forward (building
/// the state from the keys, reading it for each query), the backward counted as
/// [`BACKWARD_FLOP_FACTOR`] forwards.
fn flops(x: &Inputs, pass: Pass) -> f64 {
    let (q, k, v) = (x.q.shape(), x.k.shape(), x.v.shape());
    let f = 2.0 * (q[0] * q[3] * v[3]) as f64 * (k[1] * k[2] + q[1] * q[2]) as f64;
    match pass {
        Pass::Forward => f,
        Pass::Backward => f * BACKWARD_FLOP_FACTOR,
    }
}

/// Times linear attention's `pass` on `x` on `dev`; where the library has no such backend (a
/// build without CUDA) it is skipped with the library's reason.
pub fn run(x: &Inputs, pass: Pass, dev: Device, repeats: u32) -> CliResult<Outcome> {
    let p = LinearParams {
        causal: x.p.window == Window::CAUSAL,
        ..Default::default()
    };
    let on = device::upload(x, dev)?;
    let (q, k, v, dout) = (&on.q, &on.k, &on.v, &on.dout);
    let timed = measure(dev, repeats, flops(x, pass), || match pass {
        Pass::Forward => Ok(vec![linear_forward(q, k, v, &p)?]),
        Pass::Backward => {
            let g = linear_backward(q, k, v, dout, &p)?;
            Ok(vec![g.dq, g.dk, g.dv])
        }
    });
    outcome(timed, dev)
}

/// The figures, or a skip where the library has no such backend; other errors stand.
fn outcome(timed: CliResult<Measurement>, dev: Device) -> CliResult<Outcome> {
    match timed {
        Ok(m) => Ok(Outcome::Ran(m)),
        Err(CliError::Lib(e @ Error::Unsupported { .. })) => {
            Ok(Outcome::Skipped(format!("no {dev} path yet ({e})")))
        }
        Err(e) => Err(e),
    }
}

/// One line per curve (pass, mask, dtype, head dim, layout, and key length where it varies):
/// where linear attention overtakes flashattn, from the time ratio at each length measured.
pub fn crossover(rows: &[Row]) -> Vec<String> {
    let per_key_length = rows.iter().any(|r| r.config.nk != r.config.nq);
    let mut curves: Vec<(String, Vec<(usize, f64)>)> = Vec::new();
    for r in rows {
        let Some(Outcome::Ran(lin)) = &r.linear else {
            continue;
        };
        let c = &r.config;
        let mut key = format!(
            "{} {} D={} {} {}",
            r.pass.name(),
            if c.is_causal() { "causal" } else { "full" },
            c.d,
            c.dtype,
            c.layout.name()
        );
        if per_key_length {
            key += &format!(" Nk={}", c.nk);
        }
        let point = (c.nq, r.flash.time_ms / lin.time_ms);
        match curves.iter_mut().find(|g| g.0 == key) {
            Some(g) => g.1.push(point),
            None => curves.push((key, vec![point])),
        }
    }
    curves
        .into_iter()
        .map(|(key, mut pts)| {
            pts.sort_by_key(|p| p.0);
            format!("{key}: {}", describe(&pts))
        })
        .collect()
}

/// Where the ratio flashattn time / linear time (`(N, ratio)` by growing N) passes 1 for good.
fn describe(pts: &[(usize, f64)]) -> String {
    let faster = |p: &(usize, f64)| p.1 > 1.0;
    let (first, last) = (pts[0], pts[pts.len() - 1]);
    if pts.iter().all(faster) {
        return format!(
            "linear is faster at every N measured ({:.2}x at N={})",
            first.1, first.0
        );
    }
    if !faster(&last) {
        return format!(
            "linear does not overtake flashattn up to N={} (flashattn {:.2}x faster there)",
            last.0,
            1.0 / last.1
        );
    }
    // The last length where flashattn is still as fast; linear is faster at every one after.
    let i = pts.iter().rposition(|p| !faster(p)).unwrap_or(0);
    let ((n0, r0), (n1, r1)) = (pts[i], pts[i + 1]);
    // The ratio grows about as a power of N (N² against N): interpolate in log-log.
    let t = -r0.ln() / (r1.ln() - r0.ln());
    let at = ((n0 as f64).ln() + t * ((n1 as f64).ln() - (n0 as f64).ln())).exp();
    format!(
        "linear overtakes flashattn between N={n0} and N={n1} (about N={at:.0} by log-log \
         interpolation; {:.2}x faster at N={})",
        last.1, last.0
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fail;

    #[test]
    fn a_missing_backend_is_a_skip_and_other_errors_stand() {
        let unsupported = Error::Unsupported {
            device: "cuda",
            what: "linear attention".into(),
        };
        let skipped = outcome(Err(CliError::Lib(unsupported)), Device::Cuda(0)).unwrap();
        assert!(
            matches!(&skipped, Outcome::Skipped(why) if why.contains("no cuda:0 path yet") && why.contains("linear attention")),
            "{skipped:?}"
        );
        assert!(outcome(Err(fail("bad input")), Device::Cuda(0)).is_err());
    }

    #[test]
    fn the_crossing_is_where_linear_stays_faster() {
        // Ratio 0.5 at 1024 and 2 at 4096: 1 in the log-log middle, N=2048.
        let s = describe(&[(512, 0.3), (1024, 0.5), (4096, 2.0), (8192, 4.0)]);
        assert!(
            s.contains("between N=1024 and N=4096") && s.contains("N=2048"),
            "{s}"
        );
        // A noisy dip at 1024 counts: the crossing is after the last slower length.
        let s = describe(&[(512, 1.1), (1024, 0.9), (2048, 1.5)]);
        assert!(s.contains("between N=1024 and N=2048"), "{s}");
        let s = describe(&[(512, 1.2), (1024, 2.5)]);
        assert!(s.contains("every N measured (1.20x at N=512)"), "{s}");
        let s = describe(&[(512, 0.1), (1024, 0.25)]);
        assert!(s.contains("up to N=1024 (flashattn 4.00x faster"), "{s}");
    }
}

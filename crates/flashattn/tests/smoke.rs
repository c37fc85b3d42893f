use flashattn::reference::oracle;
use flashattn::{AttentionParams, Tensor, backward, forward};
use rand::{RngExt, SeedableRng, rngs::StdRng};

fn rand_t(rng: &mut StdRng, shape: &[usize]) -> Tensor {
    let n = shape.iter().product();
    Tensor::from_vec(
        (0..n)
            .map(|_| rng.random_range(-1.0f32..1.0))
            .collect::<Vec<_>>(),
        shape,
    )
    .unwrap()
}

fn rel(a: &[f64], b: &[f64]) -> f64 {
    let num: f64 = a.iter().zip(b).map(|(x, y)| (x - y).powi(2)).sum();
    let den: f64 = b.iter().map(|y| y * y).sum();
    (num / den.max(1e-300)).sqrt()
}

#[test]
fn smoke() {
    let mut rng = StdRng::seed_from_u64(1);
    let (b, nq, nk, h, hk, d) = (2, 33, 47, 4, 2, 16);
    let q = rand_t(&mut rng, &[b, nq, h, d]);
    let k = rand_t(&mut rng, &[b, nk, hk, d]);
    let v = rand_t(&mut rng, &[b, nk, hk, d]);
    let bias = rand_t(&mut rng, &[1, h, nq, nk]);
    let slopes = rand_t(&mut rng, &[h]);
    let p = AttentionParams::default()
        .window(5, 3)
        .softcap(2.0)
        .bias(bias)
        .alibi(slopes);
    let f = forward(&q, &k, &v, &p).unwrap();
    let o = oracle::forward(&q, &k, &v, &p).unwrap();
    let e = rel(&f.out.to_f64_vec().unwrap(), &o.out);
    println!("fwd rel {e}");
    assert!(e < 1e-5);
    let dout = rand_t(&mut rng, &[b, nq, h, d]);
    let g = backward(&q, &k, &v, &f.out, &f.lse, &dout, &p).unwrap();
    let og = oracle::backward(&q, &k, &v, &dout, &p).unwrap();
    for (name, a, r) in [
        ("dq", &g.dq, &og.dq),
        ("dk", &g.dk, &og.dk),
        ("dv", &g.dv, &og.dv),
    ] {
        let e = rel(&a.to_f64_vec().unwrap(), r);
        println!("{name} rel {e}");
        assert!(e < 1e-5, "{name} {e}");
    }
    let e = rel(&g.dbias.unwrap().to_f64_vec().unwrap(), &og.dbias.unwrap());
    println!("dbias rel {e}");
    assert!(e < 1e-5);
}

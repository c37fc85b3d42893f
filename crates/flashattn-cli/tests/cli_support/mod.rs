//! Helpers of the tests that drive the `flashattn` binary: running it, an in-test safetensors
//! writer and reader, random named inputs, error measures, temporary folders.
#![allow(dead_code)]

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};

use flashattn::{DType, Tensor};
use half::{bf16, f16};
use rand::{RngExt, rngs::StdRng};
use safetensors::tensor::{Dtype, SafeTensors, TensorView};

/// The binary under test: the one cargo built for these tests; where that path is missing (test
/// executables carried to another machine), `$FLASHATTN_BIN`, else a `flashattn` in `../bin` of
/// the test executable's folder (the staged layout: `tests/` beside `bin/`). The built one comes
/// first so that a stale `FLASHATTN_BIN` never stands in for the code just built.
fn binary() -> PathBuf {
    let built = PathBuf::from(env!("CARGO_BIN_EXE_flashattn"));
    if built.exists() {
        return built;
    }
    if let Some(path) = std::env::var_os("FLASHATTN_BIN") {
        return PathBuf::from(path);
    }
    let exe = std::env::current_exe().expect("the test executable's path");
    let beside = exe
        .parent()
        .and_then(Path::parent)
        .map(|d| d.join("bin/flashattn"));
    match beside {
        Some(path) if path.exists() => path,
        _ => panic!(
            "no flashattn binary at {} or beside {}: set FLASHATTN_BIN",
            built.display(),
            exe.display()
        ),
    }
}

/// Runs the binary with `args`, printing the command and what it wrote.
pub fn flashattn(args: &[&str]) -> Output {
    let out = Command::new(binary())
        .args(args)
        .output()
        .expect("the flashattn binary runs");
    println!(
        "$ flashattn {}\n{}{}",
        args.join(" "),
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    out
}

/// Starts the binary with `args`, its output discarded.
pub fn spawn(args: &[&str]) -> Child {
    Command::new(binary())
        .args(args)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("the flashattn binary starts")
}

pub fn stdout(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

pub fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

/// One tensor to write: name, shape, dtype and values (rounded to the dtype).
pub struct Input {
    pub name: &'static str,
    pub shape: Vec<usize>,
    pub dtype: Dtype,
    pub values: Vec<f32>,
}

pub fn random(rng: &mut StdRng, name: &'static str, shape: &[usize], dtype: Dtype) -> Input {
    let n = shape.iter().product();
    Input {
        name,
        shape: shape.to_vec(),
        dtype,
        values: (0..n).map(|_| rng.random_range(-1.5f32..1.5)).collect(),
    }
}

pub fn int32(name: &'static str, values: &[i32]) -> Input {
    Input {
        name,
        shape: vec![values.len()],
        dtype: Dtype::I32,
        values: values.iter().map(|&v| v as f32).collect(),
    }
}

pub fn le_bytes(x: &Input) -> Vec<u8> {
    let mut b = Vec::new();
    for &v in &x.values {
        match x.dtype {
            Dtype::F32 => b.extend_from_slice(&v.to_le_bytes()),
            Dtype::F16 => b.extend_from_slice(&f16::from_f32(v).to_le_bytes()),
            Dtype::BF16 => b.extend_from_slice(&bf16::from_f32(v).to_le_bytes()),
            Dtype::I32 => b.extend_from_slice(&(v as i32).to_le_bytes()),
            Dtype::F64 => b.extend_from_slice(&(v as f64).to_le_bytes()),
            other => panic!("no writer for {other}"),
        }
    }
    b
}

/// The in-test safetensors writer.
pub fn write_safetensors(path: &Path, inputs: &[Input]) {
    let bytes: Vec<Vec<u8>> = inputs.iter().map(le_bytes).collect();
    let views: Vec<(&str, TensorView)> = inputs
        .iter()
        .zip(&bytes)
        .map(|(x, b)| {
            (
                x.name,
                TensorView::new(x.dtype, x.shape.clone(), b).unwrap(),
            )
        })
        .collect();
    std::fs::write(path, safetensors::tensor::serialize(views, None).unwrap()).unwrap();
}

/// The tensor `x` as the library sees it, in the file's storage order.
pub fn tensor(x: &Input) -> Tensor {
    let t = Tensor::from_vec(x.values.clone(), &x.shape).unwrap();
    match x.dtype {
        Dtype::F16 => t.to_dtype(DType::F16).unwrap(),
        Dtype::BF16 => t.to_dtype(DType::BF16).unwrap(),
        _ => t,
    }
}

/// Every tensor of a safetensors file as (shape, dtype, values widened to f64).
pub fn read_safetensors(path: &Path) -> HashMap<String, (Vec<usize>, Dtype, Vec<f64>)> {
    let bytes = std::fs::read(path).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    st.tensors()
        .into_iter()
        .map(|(name, v)| {
            let d = v.data();
            let vals: Vec<f64> = match v.dtype() {
                Dtype::F32 => d
                    .chunks_exact(4)
                    .map(|c| f32::from_le_bytes(c.try_into().unwrap()) as f64)
                    .collect(),
                Dtype::F16 => d
                    .chunks_exact(2)
                    .map(|c| f16::from_le_bytes(c.try_into().unwrap()).to_f64())
                    .collect(),
                Dtype::BF16 => d
                    .chunks_exact(2)
                    .map(|c| bf16::from_le_bytes(c.try_into().unwrap()).to_f64())
                    .collect(),
                other => panic!("unexpected output dtype {other}"),
            };
            (name, (v.shape().to_vec(), v.dtype(), vals))
        })
        .collect()
}

/// `‖a − b‖ / denom` (0 when equal).
pub fn rel(a: &[f64], b: &[f64], denom: f64) -> f64 {
    assert_eq!(a.len(), b.len());
    let d = a
        .iter()
        .zip(b)
        .map(|(x, y)| (x - y).powi(2))
        .sum::<f64>()
        .sqrt();
    if d == 0.0 { 0.0 } else { d / denom }
}

pub fn norm(a: &[f64]) -> f64 {
    a.iter().map(|x| x * x).sum::<f64>().sqrt()
}

/// Swaps dims r-3 and r-2 of a row-major array of `shape` (bhnd <-> bnhd), for comparing the
/// oracle's `[.., seqlen, heads, dim]` order with a file in `bhnd`.
pub fn swap_seq_heads(vals: &[f64], shape: &[usize]) -> Vec<f64> {
    let t = Tensor::from_vec(vals.iter().map(|&v| v as f32).collect(), shape).unwrap();
    let r = shape.len();
    t.transpose(r - 3, r - 2).unwrap().to_f64_vec().unwrap()
}

pub struct Dir(pub tempfile::TempDir);

impl Dir {
    pub fn new() -> Self {
        Dir(tempfile::tempdir().unwrap())
    }
    pub fn path(&self, name: &str) -> PathBuf {
        self.0.path().join(name)
    }
}

pub fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

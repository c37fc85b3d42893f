//! A `flashattn run` stopped by SIGTERM or SIGINT while its output is pending leaves neither the
//! output nor the hidden temporary file beside it.
#![cfg(unix)]

mod cli_support;

use std::os::unix::process::ExitStatusExt;
use std::time::{Duration, Instant};

use cli_support::*;
use rand::{SeedableRng, rngs::StdRng};
use safetensors::tensor::Dtype;

/// The names of the files in `dir`.
fn names(dir: &Dir) -> Vec<String> {
    std::fs::read_dir(dir.0.path())
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect()
}

#[test]
fn a_stopped_run_removes_its_temporary_file() {
    let mut rng = StdRng::seed_from_u64(310);
    let dir = Dir::new();
    let input = dir.path("in.safetensors");
    // Forward and backward at N = 4096: seconds of work after the temporary file is created
    // (it is created once the inputs are read and checked, before the computation).
    let shape = [1, 4096, 8, 64];
    let inputs: Vec<Input> = ["q", "k", "v", "dout"]
        .into_iter()
        .map(|name| random(&mut rng, name, &shape, Dtype::F32))
        .collect();
    write_safetensors(&input, &inputs);
    let output = dir.path("out.safetensors");
    for (signal, number) in [("TERM", 15), ("INT", 2)] {
        let mut child = spawn(&["run", "--input", s(&input), "--output", s(&output)]);
        let start = Instant::now();
        let tmp = loop {
            if let Some(t) = names(&dir).into_iter().find(|n| n.ends_with(".tmp")) {
                break t;
            }
            let finished = child.try_wait().unwrap();
            assert!(
                finished.is_none(),
                "run ended ({finished:?}) before its temporary file was seen"
            );
            assert!(
                start.elapsed() < Duration::from_secs(60),
                "no temporary file after 60 s"
            );
            std::thread::sleep(Duration::from_millis(2));
        };
        assert!(tmp.starts_with(".flashattn-"), "{tmp}");
        let kill = std::process::Command::new("kill")
            .args([format!("-{signal}"), child.id().to_string()])
            .status()
            .unwrap();
        assert!(kill.success());
        let status = child.wait().unwrap();
        assert_eq!(status.signal(), Some(number), "SIG{signal}: {status:?}");
        assert_eq!(names(&dir), vec!["in.safetensors"], "after SIG{signal}");
    }
}

//! Run-time compilation of the embedded CUDA C++ kernels with NVRTC, and their caches.
//!
//! A [`KernelSource`] is one complete translation unit (its headers pasted in, NVRTC gets no
//! include path). [`compile_ptx`] needs only libnvrtc, no GPU: CI uses it to compile every variant.
//! `function` gives the loaded kernel on a GPU: from an in-memory cache, else from the disk
//! cache (a cubin file), else compiled by NVRTC and written to the disk cache. Both caches are
//! keyed by a hash of the source, the entry point, the NVRTC options, the architecture and the
//! NVRTC version. Every load that misses the in-memory cache is kept as a [`CompileRecord`].
//!
//! The disk cache lives in `$FLASHATTN_CACHE_DIR`, else `$XDG_CACHE_HOME/flashattn`, else
//! `~/.cache/flashattn`; `FLASHATTN_CACHE_DIR=off` disables it. Each entry is checksummed and
//! checked before the driver loads it; a damaged one is compiled again and rewritten (see
//! `disk_cache.rs`).

use std::collections::HashMap;
use std::ffi::{CStr, CString};
use std::path::PathBuf;
use std::sync::{Mutex, OnceLock};

use cudarc::driver::CudaFunction;
use cudarc::nvrtc::{Ptx, result as nvrtc, sys as nvrtc_sys};

use super::device::Gpu;
use super::disk_cache;
use crate::error::{Error, Result};

/// One kernel variant: a complete CUDA C++ translation unit and the `extern "C"` kernel in it.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct KernelSource {
    /// The variant's name (for logs, errors and records), e.g. `fwd_bf16_d128_causal`.
    pub name: String,
    /// The whole translation unit, headers included (NVRTC is given no include path).
    pub code: String,
    /// The name of the `extern "C" __global__` function to launch.
    pub entry: String,
    /// Built for sm_90a only (it uses wgmma, TMA or setmaxnreg, which other targets reject).
    pub hopper_only: bool,
}

/// Scalar types and dtype conversions (`kernels/types.cuh`): the first header of every kernel.
pub(crate) const TYPES_HEADER: &str = include_str!("../../kernels/types.cuh");

/// How one kernel variant was made ready on a GPU (a miss of the in-memory cache).
#[derive(Clone, Debug, PartialEq)]
pub struct CompileRecord {
    /// [`KernelSource::name`].
    pub name: String,
    /// The architecture it was built for.
    pub arch: String,
    /// NVRTC's compile time in milliseconds, or `None` when the disk cache had it.
    pub compile_ms: Option<f64>,
    /// Milliseconds to load the module into the context (reading the cache file included).
    pub load_ms: f64,
    /// True when the cubin came from the disk cache.
    pub from_disk: bool,
}

/// The options every kernel is compiled with (besides the architecture).
pub const NVRTC_OPTIONS: &[&str] = &["-std=c++17", "-lineinfo", "--fmad=true"];

fn nvrtc_present() -> Result<()> {
    // SAFETY: only tries to dlopen libnvrtc; no NVRTC call is made.
    if unsafe { nvrtc_sys::is_culib_present() } {
        Ok(())
    } else {
        Err(Error::NoNvrtc(
            "libnvrtc.so could not be loaded (install the CUDA toolkit's NVRTC, e.g. \
             `pip install nvidia-cuda-nvrtc`, and put its lib folder on LD_LIBRARY_PATH)"
                .into(),
        ))
    }
}

/// NVRTC's version as (major, minor), or why NVRTC cannot be used.
pub fn nvrtc_version() -> Result<(i32, i32)> {
    nvrtc_present()?;
    let (mut major, mut minor) = (0, 0);
    // SAFETY: both pointers are valid for writes for the duration of the call.
    unsafe { nvrtc_sys::nvrtcVersion(&mut major, &mut minor) }
        .result()
        .map_err(|e| Error::NoNvrtc(format!("nvrtcVersion failed: {e:?}")))?;
    Ok((major, minor))
}

/// What NVRTC returns for one program.
enum Output {
    Ptx,
    Cubin,
    /// Nothing: the front end's checks only (`-fdevice-syntax-only`).
    Nothing,
}

/// Compiles `src` for `arch` with `extra` options after the usual ones; returns the PTX or the
/// cubin bytes and NVRTC's log (ptxas's messages included when a cubin is built).
fn nvrtc_compile(
    src: &KernelSource,
    arch: &str,
    output: Output,
    extra: &[&str],
) -> Result<(Vec<u8>, String)> {
    nvrtc_present()?;
    let code = CString::new(src.code.as_str()).map_err(|_| Error::Compile {
        kernel: src.name.clone(),
        log: "the source contains a NUL byte".into(),
    })?;
    let name = CString::new(format!("{}.cu", src.name)).unwrap_or_else(|_| c"kernel.cu".into());
    let prog = nvrtc::create_program(&code, Some(&name))
        .map_err(|e| Error::Cuda(format!("nvrtcCreateProgram: {e:?}")))?;
    let mut options: Vec<String> = NVRTC_OPTIONS.iter().map(|s| s.to_string()).collect();
    options.push(format!("--gpu-architecture={arch}"));
    options.extend(extra.iter().map(|s| s.to_string()));
    // SAFETY: `prog` was created above and is destroyed once, below; `code` and `name` outlive it.
    let result = unsafe { compile_program(prog, &options, output) };
    // SAFETY: `prog` is valid and not used after this.
    let _ = unsafe { nvrtc::destroy_program(prog) };
    result.map_err(|log| Error::Compile {
        kernel: format!("{} ({arch})", src.name),
        log,
    })
}

/// A C character as a byte (`c_char` is `i8` on x86-64 and `u8` on aarch64).
fn byte(c: std::ffi::c_char) -> u8 {
    c.to_ne_bytes()[0]
}

/// NVRTC's log of `prog` (empty when it cannot be read).
///
/// # Safety
/// `prog` must be a live program on which `nvrtcCompileProgram` was called.
unsafe fn program_log(prog: nvrtc_sys::nvrtcProgram) -> String {
    // SAFETY: the caller guarantees `prog` is live and compiled.
    unsafe { nvrtc::get_program_log(prog) }
        .map(|raw| {
            let bytes: Vec<u8> = raw.iter().map(|&c| byte(c)).collect();
            CStr::from_bytes_until_nul(&bytes)
                .map(|s| s.to_string_lossy().into_owned())
                .unwrap_or_default()
        })
        .unwrap_or_default()
}

/// Compiles `prog` and extracts the output and the log; on failure returns NVRTC's log.
///
/// # Safety
/// `prog` must be a live program from `nvrtc::create_program`.
unsafe fn compile_program(
    prog: nvrtc_sys::nvrtcProgram,
    options: &[String],
    output: Output,
) -> std::result::Result<(Vec<u8>, String), String> {
    // SAFETY: the caller guarantees `prog` is live.
    let compiled = unsafe { nvrtc::compile_program(prog, options) };
    // SAFETY: as above; the compile was attempted.
    let log = unsafe { program_log(prog) };
    if let Err(e) = compiled {
        return Err(format!("{e:?} with options {options:?}\n{log}"));
    }
    let bytes = match output {
        Output::Ptx => {
            // SAFETY: the program compiled.
            let raw = unsafe { nvrtc::get_ptx(prog) }.map_err(|e| format!("nvrtcGetPTX: {e:?}"))?;
            raw.iter()
                .map(|&c| byte(c))
                .take_while(|&b| b != 0)
                .collect()
        }
        Output::Cubin => {
            let mut size = 0usize;
            // SAFETY: the program compiled; `size` is valid for writes.
            unsafe { nvrtc_sys::nvrtcGetCUBINSize(prog, &mut size) }
                .result()
                .map_err(|e| format!("nvrtcGetCUBINSize: {e:?}"))?;
            let mut bin = vec![0u8; size];
            // SAFETY: `bin` holds the `size` bytes NVRTC writes.
            unsafe { nvrtc_sys::nvrtcGetCUBIN(prog, bin.as_mut_ptr().cast()) }
                .result()
                .map_err(|e| format!("nvrtcGetCUBIN: {e:?}"))?;
            bin
        }
        Output::Nothing => Vec::new(),
    };
    Ok((bytes, log))
}

/// Compiles `src` to PTX for `arch` (e.g. `sm_80`, `sm_90a`) with NVRTC. Needs libnvrtc but no
/// GPU. A kernel NVRTC rejects gives [`Error::Compile`] with the compile log.
pub fn compile_ptx(src: &KernelSource, arch: &str) -> Result<String> {
    let (bytes, _) = nvrtc_compile(src, arch, Output::Ptx, &[])?;
    String::from_utf8(bytes).map_err(|e| Error::Cuda(format!("NVRTC returned non-UTF-8 PTX: {e}")))
}

/// Compiles `src` to a cubin for `arch` (a real architecture, e.g. `sm_90a`) with ptxas's verbose
/// report (`--ptxas-options=-v`) and returns the cubin and NVRTC's log: registers, spills, and
/// warnings such as wgmma serialization (C7515). Needs libnvrtc but no GPU; nothing is cached.
pub fn ptxas_report(src: &KernelSource, arch: &str) -> Result<(Vec<u8>, String)> {
    nvrtc_compile(src, arch, Output::Cubin, &["--ptxas-options=-v"])
}

/// Runs only NVRTC's front end on `src` for `arch` (`-fdevice-syntax-only`): the C++ checks of
/// the whole translation unit, in a twentieth of a full compile. Needs libnvrtc but no GPU.
pub fn check_syntax(src: &KernelSource, arch: &str) -> Result<()> {
    nvrtc_compile(src, arch, Output::Nothing, &["-fdevice-syntax-only"]).map(|_| ())
}

/// 128-bit FNV-1a over length-prefixed parts: stable across builds and platforms.
fn cache_key(parts: &[&[u8]]) -> u128 {
    const PRIME: u128 = 0x0000000001000000000000000000013B;
    let mut h: u128 = 0x6c62272e07bb014262b821756295c58d;
    for part in parts {
        for b in (part.len() as u64).to_le_bytes().iter().chain(part.iter()) {
            h ^= u128::from(*b);
            h = h.wrapping_mul(PRIME);
        }
    }
    h
}

/// The disk cache folder, or `None` when disabled or no home is known.
pub fn cache_dir() -> Option<PathBuf> {
    match std::env::var_os("FLASHATTN_CACHE_DIR") {
        Some(d) if d == "off" => None,
        Some(d) if !d.is_empty() => Some(PathBuf::from(d)),
        _ => std::env::var_os("XDG_CACHE_HOME")
            .filter(|d| !d.is_empty())
            .map(|d| PathBuf::from(d).join("flashattn"))
            .or_else(|| {
                std::env::var_os("HOME")
                    .filter(|d| !d.is_empty())
                    .map(|d| PathBuf::from(d).join(".cache").join("flashattn"))
            }),
    }
}

/// Loaded kernels by (GPU ordinal, variant name, entry); each entry keeps the source it was built
/// from, compared in full on lookup (a memcmp, cheaper than hashing the source on every launch).
type FunctionCache = HashMap<(usize, String, String), Vec<(String, CudaFunction)>>;

fn function_cache() -> &'static Mutex<FunctionCache> {
    static CACHE: OnceLock<Mutex<FunctionCache>> = OnceLock::new();
    CACHE.get_or_init(Default::default)
}

fn records() -> &'static Mutex<Vec<CompileRecord>> {
    static RECORDS: OnceLock<Mutex<Vec<CompileRecord>>> = OnceLock::new();
    RECORDS.get_or_init(Default::default)
}

/// Forgets the loaded kernels of [`function`] (see [`super::forget_loaded_kernels`]).
pub(crate) fn forget_functions() {
    function_cache()
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .clear();
}

/// Every kernel load of this process that missed the in-memory cache, in order: the first use of
/// each variant on each GPU (compiled by NVRTC or read from the disk cache) and every
/// [`measure_compile`].
pub fn compile_records() -> Vec<CompileRecord> {
    records().lock().unwrap_or_else(|p| p.into_inner()).clone()
}

fn key_for(src: &KernelSource, arch: &str) -> Result<u128> {
    let (major, minor) = nvrtc_version()?;
    let options = NVRTC_OPTIONS.join(" ");
    let version = format!("nvrtc {major}.{minor}");
    Ok(cache_key(&[
        src.code.as_bytes(),
        src.entry.as_bytes(),
        options.as_bytes(),
        arch.as_bytes(),
        version.as_bytes(),
    ]))
}

fn load(gpu: &Gpu, src: &KernelSource, cubin: &[u8]) -> Result<CudaFunction> {
    let module = gpu
        .ctx
        .load_module(Ptx::from_binary(cubin.to_vec()))
        .map_err(Gpu::err("loading a compiled module"))?;
    module.load_function(&src.entry).map_err(|e| {
        Error::Cuda(format!(
            "kernel `{}` has no entry `{}`: {e:?}",
            src.name, src.entry
        ))
    })
}

/// The kernel of `src` loaded on `gpu`, compiled on first use (see the module docs for the caches).
pub(crate) fn function(gpu: &Gpu, src: &KernelSource) -> Result<CudaFunction> {
    if src.hopper_only && gpu.arch != "sm_90a" {
        return Err(Error::Unsupported {
            device: "cuda",
            what: format!("kernel `{}` on {} (it needs sm_90a)", src.name, gpu.arch),
        });
    }
    let mut cache = function_cache().lock().unwrap_or_else(|p| p.into_inner());
    let slot = cache
        .entry((gpu.ordinal, src.name.clone(), src.entry.clone()))
        .or_default();
    if let Some((_, f)) = slot.iter().find(|(code, _)| *code == src.code) {
        return Ok(f.clone());
    }
    let key = key_for(src, &gpu.arch)?;
    let (f, record) = load_uncached(gpu, src, key, true)?;
    slot.push((src.code.clone(), f.clone()));
    drop(cache);
    records()
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .push(record);
    Ok(f)
}

/// Compiles and loads, timing both steps. With `use_disk` the cubin is read from the disk cache
/// when there and sound, and written to it after a compile; without, the disk cache is left alone.
fn load_uncached(
    gpu: &Gpu,
    src: &KernelSource,
    key: u128,
    use_disk: bool,
) -> Result<(CudaFunction, CompileRecord)> {
    let path = cache_dir()
        .filter(|d| use_disk && disk_cache::trusted_dir(d))
        .map(|d| d.join(format!("{}-{}-{key:032x}.cubin", src.name, gpu.arch)));
    let (f, outcome) = disk_cache::load_or_build(
        path.as_deref(),
        key,
        || nvrtc_compile(src, &gpu.arch, Output::Cubin, &[]).map(|(cubin, _)| cubin),
        |cubin| load(gpu, src, cubin),
    )?;
    let record = CompileRecord {
        name: src.name.clone(),
        arch: gpu.arch.clone(),
        compile_ms: outcome.build_ms,
        load_ms: outcome.load_ms,
        from_disk: outcome.bad.is_none(),
    };
    Ok((f, record))
}

/// Measures both costs of `src` on GPU `ordinal` regardless of the caches: a fresh NVRTC compile
/// (of the source with an empty kernel of a unique name appended, which the CUDA stack's own
/// `~/.nv/ComputeCache` cannot have; not written to the disk cache), then a load through the
/// disk cache (a compile, when the cache is off or lacks `src`). Returns both records (the
/// compile's `load_ms` is the module load after it), also appended to [`compile_records`].
pub fn measure_compile(
    ordinal: usize,
    src: &KernelSource,
) -> Result<(CompileRecord, CompileRecord)> {
    let gpu = super::device::gpu(ordinal)?;
    let gpu = &*gpu;
    static NONCE: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let nonce = NONCE.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let stamp = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos());
    let unique = KernelSource {
        code: format!(
            "{}\nextern \"C\" __global__ void flashattn_fresh_compile_{stamp}_{}_{nonce}() {{}}\n",
            src.code,
            std::process::id()
        ),
        ..src.clone()
    };
    let (_, fresh) = load_uncached(gpu, &unique, key_for(&unique, &gpu.arch)?, false)?;
    let (_, cached) = load_uncached(gpu, src, key_for(src, &gpu.arch)?, true)?;
    let mut r = records().lock().unwrap_or_else(|p| p.into_inner());
    r.push(fresh.clone());
    r.push(cached.clone());
    Ok((fresh, cached))
}

#[cfg(test)]
mod tests {
    use super::cache_key;

    #[test]
    fn cache_key_separates_parts() {
        assert_ne!(cache_key(&[b"ab", b"c"]), cache_key(&[b"a", b"bc"]));
        assert_eq!(cache_key(&[b"x"]), cache_key(&[b"x"]));
        assert_ne!(cache_key(&[b"sm_80"]), cache_key(&[b"sm_90a"]));
    }
}

//! Output files are written whole or not at all: into a temporary file in the destination's
//! folder, then renamed over the destination.

use std::io::Write;
use std::path::Path;

use super::{CliResult, fail};

/// The folder `path` will be written in (`.` for a bare file name).
fn folder(path: &Path) -> &Path {
    match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p,
        _ => Path::new("."),
    }
}

/// Checks, before any work, that `path` names a file in an existing folder.
pub fn check_writable(path: &Path) -> CliResult<()> {
    let dir = folder(path);
    if !dir.is_dir() {
        return Err(fail(format!(
            "cannot write {}: folder {} does not exist",
            path.display(),
            dir.display()
        )));
    }
    if path.is_dir() {
        return Err(fail(format!(
            "cannot write {}: it is a folder",
            path.display()
        )));
    }
    Ok(())
}

/// Writes `path` atomically with `fill`, which writes the content into the file it is given.
pub fn write_atomic(
    path: &Path,
    fill: impl FnOnce(&mut std::fs::File) -> CliResult<()>,
) -> CliResult<()> {
    let err = |what: &str, e: std::io::Error| fail(format!("{what} {}: {e}", path.display()));
    let mut builder = tempfile::Builder::new();
    builder.prefix(".flashattn-").suffix(".tmp");
    // The temporary file is private (0600) by default; the result gets the usual mode.
    #[cfg(unix)]
    builder.permissions(std::os::unix::fs::PermissionsExt::from_mode(0o644));
    let mut tmp = builder
        .tempfile_in(folder(path))
        .map_err(|e| err("cannot create a temporary file beside", e))?;
    fill(tmp.as_file_mut())?;
    tmp.as_file_mut()
        .flush()
        .and_then(|()| tmp.as_file().sync_all())
        .map_err(|e| err("cannot write", e))?;
    tmp.persist(path)
        .map_err(|e| err("cannot rename the temporary file to", e.error))?;
    Ok(())
}

/// Writes `bytes` to `path` atomically.
pub fn write_bytes_atomic(path: &Path, bytes: &[u8]) -> CliResult<()> {
    write_atomic(path, |f| {
        f.write_all(bytes)
            .map_err(|e| fail(format!("cannot write {}: {e}", path.display())))
    })
}

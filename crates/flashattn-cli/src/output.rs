//! Output files are written whole or not at all: into a temporary file in the destination's
//! folder, then renamed over the destination. A temporary file is removed when the write fails
//! and, on Unix, when the process is stopped by SIGINT, SIGTERM or SIGHUP.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::{Mutex, MutexGuard};

use tempfile::NamedTempFile;

use super::{CliResult, fail};

/// The temporary files being written now, removed by the signal handler.
static PENDING: Mutex<Vec<PathBuf>> = Mutex::new(Vec::new());

/// The list of temporary files; a thread that panicked holding it left it whole.
fn pending() -> MutexGuard<'static, Vec<PathBuf>> {
    PENDING.lock().unwrap_or_else(|e| e.into_inner())
}

/// Removes every temporary file being written (what an interrupted process leaves).
fn remove_pending() {
    for path in pending().drain(..) {
        // Already renamed or removed: nothing is left to clean up.
        let _ = std::fs::remove_file(path);
    }
}

/// Starts, once, a thread that on SIGINT, SIGTERM or SIGHUP removes the temporary files and
/// then ends the process as the signal would have.
#[cfg(unix)]
fn install_signal_handler() {
    use signal_hook::consts::{SIGHUP, SIGINT, SIGTERM};
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        let Ok(mut signals) = signal_hook::iterator::Signals::new([SIGINT, SIGTERM, SIGHUP]) else {
            eprintln!("warning: no signal handler: an interrupted write may leave a .tmp file");
            return;
        };
        std::thread::spawn(move || {
            if let Some(signal) = signals.forever().next() {
                remove_pending();
                let _ = signal_hook::low_level::emulate_default_handler(signal);
                std::process::exit(128 + signal);
            }
        });
    });
}

#[cfg(not(unix))]
fn install_signal_handler() {}

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

/// An output file being written: a hidden `.flashattn-*.tmp` beside its destination until
/// [`PendingFile::finish`] renames it over the destination. Dropped unfinished, it is removed.
pub struct PendingFile {
    tmp: NamedTempFile,
    path: PathBuf,
    listed: Listed,
}

/// A temporary file's place in [`PENDING`], given up when it is dropped.
struct Listed(PathBuf);

impl Drop for Listed {
    fn drop(&mut self) {
        pending().retain(|p| *p != self.0);
    }
}

impl PendingFile {
    /// Creates the temporary file for `path`; creating it early tells at once that the folder
    /// cannot be written, before any long computation.
    pub fn create(path: &Path) -> CliResult<Self> {
        check_writable(path)?;
        let mut builder = tempfile::Builder::new();
        builder.prefix(".flashattn-").suffix(".tmp");
        // The temporary file is private (0600) by default; the result gets the usual mode.
        #[cfg(unix)]
        builder.permissions(std::os::unix::fs::PermissionsExt::from_mode(0o644));
        install_signal_handler();
        // Created and listed under the lock, so that a signal never finds it unlisted.
        let mut list = pending();
        let tmp = builder.tempfile_in(folder(path)).map_err(|e| {
            fail(format!(
                "cannot create a temporary file beside {}: {e}",
                path.display()
            ))
        })?;
        list.push(tmp.path().to_path_buf());
        Ok(PendingFile {
            listed: Listed(tmp.path().to_path_buf()),
            tmp,
            path: path.to_path_buf(),
        })
    }

    /// The destination.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Writes the content with `fill` and renames the file over the destination.
    pub fn finish(
        mut self,
        fill: impl FnOnce(&mut std::fs::File) -> CliResult<()>,
    ) -> CliResult<()> {
        let path = self.path.clone();
        let err = |what: &str, e: std::io::Error| fail(format!("{what} {}: {e}", path.display()));
        fill(self.tmp.as_file_mut())?;
        self.tmp
            .as_file_mut()
            .flush()
            .and_then(|()| self.tmp.as_file().sync_all())
            .map_err(|e| err("cannot write", e))?;
        let PendingFile { tmp, listed, .. } = self;
        // Renamed and unlisted under the lock, so that a signal never removes a finished file.
        let renamed = {
            let mut list = pending();
            let renamed = tmp.persist(&path);
            list.retain(|p| *p != listed.0);
            renamed
        };
        renamed.map_err(|e| err("cannot rename the temporary file to", e.error))?;
        Ok(())
    }
}

/// Writes `bytes` to `path` atomically.
pub fn write_bytes_atomic(path: &Path, bytes: &[u8]) -> CliResult<()> {
    PendingFile::create(path)?.finish(|f| {
        f.write_all(bytes)
            .map_err(|e| fail(format!("cannot write {}: {e}", path.display())))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pending_files_are_removed_and_finished_ones_kept() {
        let dir = tempfile::tempdir().unwrap();
        let kept = dir.path().join("kept.bin");
        write_bytes_atomic(&kept, b"whole").unwrap();
        let interrupted = PendingFile::create(&dir.path().join("cut.bin")).unwrap();
        let tmp = interrupted.tmp.path().to_path_buf();
        assert!(tmp.exists());
        assert!(pending().contains(&tmp));
        remove_pending();
        assert!(!tmp.exists(), "{} was left", tmp.display());
        assert_eq!(std::fs::read(&kept).unwrap(), b"whole");
        assert!(!dir.path().join("cut.bin").exists());
        drop(interrupted);
        let dropped = PendingFile::create(&dir.path().join("dropped.bin")).unwrap();
        let tmp = dropped.tmp.path().to_path_buf();
        drop(dropped);
        assert!(!tmp.exists() && !pending().contains(&tmp));
    }
}

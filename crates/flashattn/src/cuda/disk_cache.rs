//! The kernel disk cache: one file per compiled kernel, checked before the driver sees it.
//!
//! The driver does not validate a cubin: loading a truncated or altered one can crash the
//! process. So each entry carries a header (a magic tag, the cache key it was written for, the
//! payload's length and a 64-bit FNV-1a checksum of the payload), and an entry that fails any
//! check is treated as missing: the kernel is compiled again and the entry rewritten. A
//! checksummed entry the driver still refuses is rebuilt the same way. Writes go through a
//! temporary file renamed into place, so a reader never sees half an entry, and the folder is
//! created private to the user (mode 0700 on unix); an existing one of this user is made private,
//! another user's is not used.

use std::path::Path;
use std::time::Instant;

use crate::error::Result;

/// The first bytes of every entry; the last byte is the format's version.
const MAGIC: [u8; 8] = *b"FAcubin1";
/// Magic, key (16 bytes), payload length (8) and checksum (8).
const HEADER_LEN: usize = 8 + 16 + 8 + 8;

/// 64-bit FNV-1a. Any single changed byte changes the sum: each step is a bijection of the state.
pub(crate) fn fnv1a64(bytes: &[u8]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for &b in bytes {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    h
}

/// `payload` with the header for `key` in front.
pub(crate) fn encode(key: u128, payload: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(HEADER_LEN + payload.len());
    out.extend_from_slice(&MAGIC);
    out.extend_from_slice(&key.to_le_bytes());
    out.extend_from_slice(&(payload.len() as u64).to_le_bytes());
    out.extend_from_slice(&fnv1a64(payload).to_le_bytes());
    out.extend_from_slice(payload);
    out
}

/// Why an entry was not used.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Unusable {
    /// No file (or it could not be read).
    Missing,
    /// Shorter than a header, or not starting with [`MAGIC`].
    BadHeader,
    /// Written for another cache key.
    WrongKey,
    /// The payload is shorter or longer than the header says.
    WrongLength,
    /// The payload's checksum does not match the header's.
    WrongChecksum,
    /// The entry was sound but the loader refused it (a cubin another driver made, say).
    Refused,
}

/// The payload of an entry for `key`, after checking its header, length and checksum.
pub(crate) fn decode(key: u128, entry: &[u8]) -> std::result::Result<&[u8], Unusable> {
    if entry.len() < HEADER_LEN || entry[..8] != MAGIC {
        return Err(Unusable::BadHeader);
    }
    let field = |at: usize| u64::from_le_bytes(entry[at..at + 8].try_into().expect("8 bytes"));
    let stored_key = u128::from_le_bytes(entry[8..24].try_into().expect("16 bytes"));
    if stored_key != key {
        return Err(Unusable::WrongKey);
    }
    let payload = &entry[HEADER_LEN..];
    if field(24) != payload.len() as u64 {
        return Err(Unusable::WrongLength);
    }
    if field(32) != fnv1a64(payload) {
        return Err(Unusable::WrongChecksum);
    }
    Ok(payload)
}

/// The checked payload of the entry at `path`.
pub(crate) fn read(path: &Path, key: u128) -> std::result::Result<Vec<u8>, Unusable> {
    let mut entry = std::fs::read(path).map_err(|_| Unusable::Missing)?;
    let len = decode(key, &entry)?.len();
    entry.drain(..entry.len() - len);
    Ok(entry)
}

/// Creates `dir` and its missing parents, private to the user on unix.
fn create_private_dir(dir: &Path) -> std::io::Result<()> {
    let mut builder = std::fs::DirBuilder::new();
    builder.recursive(true);
    #[cfg(unix)]
    std::os::unix::fs::DirBuilderExt::mode(&mut builder, 0o700);
    builder.create(dir)
}

/// Whether `dir` may hold the cache: absent (it is then created private), or owned by this user,
/// in which case a folder others may read or write is made private first. Another user's
/// folder is refused, since a checksum catches damage, not a planted cubin.
pub(crate) fn trusted_dir(dir: &Path) -> bool {
    #[cfg(target_os = "linux")]
    {
        use std::os::unix::fs::{MetadataExt, PermissionsExt};
        let Ok(meta) = std::fs::metadata(dir) else {
            return true;
        };
        // SAFETY: geteuid has no preconditions and cannot fail.
        if !meta.is_dir() || meta.uid() != unsafe { libc::geteuid() } {
            return false;
        }
        if meta.mode() & 0o077 != 0 {
            let private = std::fs::Permissions::from_mode(0o700);
            return std::fs::set_permissions(dir, private).is_ok();
        }
    }
    #[cfg(not(target_os = "linux"))]
    let _ = dir;
    true
}

/// Writes the entry for `key` to `path` through a temporary file in the same folder and a rename.
pub(crate) fn write(path: &Path, key: u128, payload: &[u8]) -> std::io::Result<()> {
    let dir = path.parent().unwrap_or(Path::new("."));
    create_private_dir(dir)?;
    static SEQ: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let seq = SEQ.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let tmp = dir.join(format!(
        ".tmp-{}-{seq}-{}",
        std::process::id(),
        path.file_name().and_then(|n| n.to_str()).unwrap_or("entry")
    ));
    std::fs::write(&tmp, encode(key, payload))
        .and_then(|()| std::fs::rename(&tmp, path))
        .inspect_err(|_| {
            let _ = std::fs::remove_file(&tmp);
        })
}

/// What [`load_or_build`] did.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) struct Outcome {
    /// Why the disk entry was not used, or `None` when it was.
    pub bad: Option<Unusable>,
    /// Milliseconds in `build`, when it ran.
    pub build_ms: Option<f64>,
    /// Milliseconds reading the entry and in `load` (the calls that ended in the result).
    pub load_ms: f64,
}

/// `load` applied to the entry at `path` for `key` when it is sound and `load` accepts it; else
/// to the bytes of `build`, which are then written to `path` (a cache that cannot be written is
/// skipped: it only saves time). `path = None` always builds and writes nothing.
pub(crate) fn load_or_build<T>(
    path: Option<&Path>,
    key: u128,
    build: impl FnOnce() -> Result<Vec<u8>>,
    load: impl Fn(&[u8]) -> Result<T>,
) -> Result<(T, Outcome)> {
    let t0 = Instant::now();
    let bad = match path.map(|p| read(p, key)) {
        Some(Ok(bytes)) => match load(&bytes) {
            Ok(value) => {
                let load_ms = t0.elapsed().as_secs_f64() * 1e3;
                let outcome = Outcome {
                    bad: None,
                    build_ms: None,
                    load_ms,
                };
                return Ok((value, outcome));
            }
            Err(_) => Unusable::Refused,
        },
        Some(Err(bad)) => bad,
        None => Unusable::Missing,
    };
    let t1 = Instant::now();
    let bytes = build()?;
    let build_ms = t1.elapsed().as_secs_f64() * 1e3;
    let t2 = Instant::now();
    let value = load(&bytes)?;
    let load_ms = t2.elapsed().as_secs_f64() * 1e3;
    if let Some(p) = path {
        let _ = write(p, key, &bytes);
    }
    let outcome = Outcome {
        bad: Some(bad),
        build_ms: Some(build_ms),
        load_ms,
    };
    Ok((value, outcome))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::cell::Cell;
    use std::path::PathBuf;

    const KEY: u128 = 0x0123_4567_89ab_cdef_fedc_ba98_7654_3210;

    /// A fresh, empty folder under the system's temporary folder.
    fn scratch(name: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!(
            "flashattn-disk-cache-{name}-{}-{:?}",
            std::process::id(),
            std::time::SystemTime::now()
        ));
        let _ = std::fs::remove_dir_all(&dir);
        dir
    }

    /// Random-looking bytes of length `n`, different for each `seed`.
    fn payload(n: usize, seed: u64) -> Vec<u8> {
        let mut x = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
        (0..n)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                x as u8
            })
            .collect()
    }

    #[test]
    fn a_written_entry_reads_back() {
        let body = payload(1000, 1);
        let entry = encode(KEY, &body);
        assert_eq!(entry.len(), HEADER_LEN + body.len());
        assert_eq!(decode(KEY, &entry), Ok(&body[..]));
        assert_eq!(decode(KEY, &encode(KEY, &[])), Ok(&[][..]));
    }

    #[test]
    fn every_truncation_is_detected() {
        let entry = encode(KEY, &payload(300, 2));
        for len in 0..entry.len() {
            let got = decode(KEY, &entry[..len]);
            let want = if len < HEADER_LEN {
                Unusable::BadHeader
            } else {
                Unusable::WrongLength
            };
            assert_eq!(got, Err(want), "truncated to {len} bytes");
        }
    }

    #[test]
    fn every_flipped_byte_is_detected() {
        let entry = encode(KEY, &payload(300, 3));
        for at in 0..entry.len() {
            for flip in [0x01u8, 0x80, 0xff] {
                let mut bad = entry.clone();
                bad[at] ^= flip;
                let got = decode(KEY, &bad);
                let want = match at {
                    0..8 => Unusable::BadHeader,
                    8..24 => Unusable::WrongKey,
                    24..32 => Unusable::WrongLength,
                    _ => Unusable::WrongChecksum,
                };
                assert_eq!(got, Err(want), "byte {at} xor {flip:#x}");
            }
        }
    }

    #[test]
    fn empty_missing_foreign_and_old_files_are_rejected() {
        let dir = scratch("rejected");
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("k.cubin");
        assert_eq!(read(&path, KEY), Err(Unusable::Missing));
        std::fs::write(&path, b"").unwrap();
        assert_eq!(read(&path, KEY), Err(Unusable::BadHeader));
        // A bare cubin, as the cache stored them before entries had a header.
        let bare = payload(HEADER_LEN * 4, 4);
        std::fs::write(&path, &bare).unwrap();
        assert_eq!(read(&path, KEY), Err(Unusable::BadHeader));
        let mut other_version = encode(KEY, &bare);
        other_version[7] = b'0';
        std::fs::write(&path, &other_version).unwrap();
        assert_eq!(read(&path, KEY), Err(Unusable::BadHeader));
        std::fs::write(&path, encode(KEY ^ 1, &bare)).unwrap();
        assert_eq!(read(&path, KEY), Err(Unusable::WrongKey));
        std::fs::write(&path, encode(KEY, &bare)).unwrap();
        assert_eq!(read(&path, KEY), Ok(bare));
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn writes_leave_no_temporary_files_and_a_private_folder() {
        let dir = scratch("write").join("nested");
        let path = dir.join("k.cubin");
        write(&path, KEY, &payload(64, 5)).unwrap();
        write(&path, KEY, &payload(65, 6)).unwrap();
        assert_eq!(read(&path, KEY), Ok(payload(65, 6)));
        let names: Vec<_> = std::fs::read_dir(&dir)
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(names, ["k.cubin"]);
        #[cfg(unix)]
        {
            use std::os::unix::fs::PermissionsExt;
            let mode = std::fs::metadata(&dir).unwrap().permissions().mode();
            assert_eq!(mode & 0o777, 0o700, "{mode:o}");
        }
        std::fs::remove_dir_all(dir.parent().unwrap()).unwrap();
    }

    /// `load_or_build` on `path` with a builder returning `body` and counting its calls, and a
    /// loader that refuses the first `refusals` byte strings it is given.
    fn fetch(path: &Path, body: &[u8], builds: &Cell<u32>, refusals: u32) -> (Vec<u8>, Outcome) {
        let seen = Cell::new(0);
        load_or_build(
            Some(path),
            KEY,
            || {
                builds.set(builds.get() + 1);
                Ok(body.to_vec())
            },
            |bytes| {
                seen.set(seen.get() + 1);
                if seen.get() <= refusals {
                    Err(crate::Error::Cuda("refused".into()))
                } else {
                    Ok(bytes.to_vec())
                }
            },
        )
        .unwrap()
    }

    #[test]
    fn bad_entries_are_rebuilt_and_rewritten() {
        let dir = scratch("rebuild");
        let path = dir.join("k.cubin");
        let body = payload(500, 7);
        let builds = Cell::new(0);
        let (got, outcome) = fetch(&path, &body, &builds, 0);
        assert_eq!(
            (got, outcome.bad, builds.get()),
            (body.clone(), Some(Unusable::Missing), 1)
        );
        assert!(outcome.build_ms.is_some());
        let (got, outcome) = fetch(&path, &body, &builds, 0);
        assert_eq!((got, outcome.bad, builds.get()), (body.clone(), None, 1));
        assert_eq!(outcome.build_ms, None);

        let good = std::fs::read(&path).unwrap();
        let mut flipped = good.clone();
        flipped[HEADER_LEN + 250] ^= 0x10;
        let damaged: [(&[u8], Unusable); 4] = [
            (&good[..good.len() / 2], Unusable::WrongLength),
            (&flipped, Unusable::WrongChecksum),
            (&[], Unusable::BadHeader),
            (&body, Unusable::BadHeader),
        ];
        for (bytes, why) in damaged {
            std::fs::write(&path, bytes).unwrap();
            let before = builds.get();
            let (got, outcome) = fetch(&path, &body, &builds, 0);
            assert_eq!((got, outcome.bad), (body.clone(), Some(why)));
            assert_eq!(builds.get(), before + 1, "{why:?} rebuilt once");
            assert_eq!(std::fs::read(&path).unwrap(), good, "{why:?} rewritten");
        }

        // A sound entry the loader refuses is rebuilt, reloaded and rewritten too.
        let other = payload(400, 8);
        write(&path, KEY, &other).unwrap();
        let before = builds.get();
        let (got, outcome) = fetch(&path, &body, &builds, 1);
        assert_eq!((got, outcome.bad), (body.clone(), Some(Unusable::Refused)));
        assert_eq!(builds.get(), before + 1);
        assert_eq!(read(&path, KEY), Ok(body.clone()));

        std::fs::remove_file(&path).unwrap();
        let (got, outcome) = fetch(&path, &body, &builds, 0);
        assert_eq!((got, outcome.bad), (body, Some(Unusable::Missing)));
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn without_a_folder_nothing_is_read_or_written() {
        let builds = Cell::new(0);
        let (got, outcome) = load_or_build(
            None,
            KEY,
            || {
                builds.set(builds.get() + 1);
                Ok(vec![1, 2, 3])
            },
            |b| Ok(b.to_vec()),
        )
        .unwrap();
        assert_eq!((got, builds.get()), (vec![1, 2, 3], 1));
        assert_eq!(outcome.bad, Some(Unusable::Missing));
    }

    /// A folder of this user that others may use is made private; an absent one is accepted
    /// (writing creates it 0700); a file in the folder's place is refused.
    #[cfg(target_os = "linux")]
    #[test]
    fn only_a_private_folder_of_this_user_is_trusted() {
        use std::os::unix::fs::PermissionsExt;
        let dir = scratch("trusted");
        std::fs::create_dir_all(&dir).unwrap();
        let mode = |d: &Path| std::fs::metadata(d).unwrap().permissions().mode() & 0o777;
        std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o777)).unwrap();
        assert!(trusted_dir(&dir));
        assert_eq!(mode(&dir), 0o700);
        let fresh = dir.join("a").join("b");
        assert!(trusted_dir(&fresh));
        write(&fresh.join("entry.cubin"), KEY, &payload(10, 9)).unwrap();
        assert_eq!(mode(&fresh), 0o700);
        let file = dir.join("plain-file");
        std::fs::write(&file, b"x").unwrap();
        assert!(!trusted_dir(&file));
        std::fs::remove_dir_all(&dir).unwrap();
    }
}

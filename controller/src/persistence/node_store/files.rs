//! The node-local store's file operations, safe in a directory other pods of the node may
//! write to.
//!
//! The store is a hostPath: whoever else can write on the node (another pod with a hostPath
//! mount, a careless script) may plant a symbolic link where a state file is expected. A link
//! followed on reading would feed the controller someone else's file as an object's records;
//! followed on writing, it would overwrite whatever it points to with the controller's
//! privileges. So nothing here follows a link at the last component: files are opened with
//! `O_NOFOLLOW` (a link is an error, `ELOOP`), sizes are taken of the entry itself, removals
//! unlink the entry, and replacements are written to a fresh temporary file (created with
//! `O_EXCL` by `tempfile`, never an existing entry) that is renamed over the old one —
//! a rename replaces a link itself, never its target.

use std::{
    fs::File,
    io::{Read as _, Write as _},
    os::unix::fs::OpenOptionsExt as _,
    path::Path,
};

/// The suffix of temporary files (a crash may leave them behind: [`is_temporary`]).
const TEMPORARY: &str = ".tmp";

/// Opens the file at `path` for reading, never following a link there.
///
/// # Errors
/// As `open(2)`; a link is `ELOOP` (not `NotFound`: something is there).
pub fn open(path: &Path) -> std::io::Result<File> {
    std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(nofollow())
        .open(path)
}

/// The whole file at `path`, never following a link there.
///
/// # Errors
/// As [`open`] and `read(2)` (a directory is `EISDIR`).
pub fn read(path: &Path) -> std::io::Result<Vec<u8>> {
    let mut file = open(path)?;
    let mut text = Vec::new();
    file.read_to_end(&mut text)?;
    Ok(text)
}

/// Opens (creating it) the file at `path` for writing without truncating it, never following
/// a link there: for a lock file.
///
/// # Errors
/// As `open(2)`.
pub fn open_or_create(path: &Path) -> std::io::Result<File> {
    std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .mode(0o600)
        .custom_flags(nofollow())
        .open(path)
}

/// The size of the regular file at `path`; `None` when there is none (or something else).
pub fn size(path: &Path) -> Option<u64> {
    std::fs::symlink_metadata(path)
        .ok()
        .filter(std::fs::Metadata::is_file)
        .map(|m| m.len())
}

/// Replaces the entry at `path` (in `dir`) with a file holding `text`, atomically and
/// durably: written to a new temporary file in `dir`, fsynced, renamed over `path`, and the
/// directory fsynced. With `clobber` false, an existing entry is left alone and the call
/// fails with `AlreadyExists`. Returns the old size (of a regular file) and the new one.
///
/// # Errors
/// As the writes and the rename.
pub fn replace(dir: &Path, path: &Path, text: &[u8], clobber: bool) -> std::io::Result<(Option<u64>, u64)> {
    let old = size(path);
    let mut file = tempfile::Builder::new()
        .prefix(".")
        .suffix(TEMPORARY)
        .tempfile_in(dir)?;
    file.write_all(text)?;
    file.as_file().sync_all()?;
    let persisted = if clobber {
        file.persist(path)
    } else {
        file.persist_noclobber(path)
    };
    persisted.map_err(|e| e.error)?;
    sync_dir(dir)?;
    Ok((old, text.len() as u64))
}

/// Removes the entry at `path` (a link itself, never its target) and makes that durable;
/// returns the size of the regular file removed, `None` when nothing was there.
///
/// # Errors
/// As `unlink(2)` (other than `NotFound`) and the fsync.
pub fn remove(dir: &Path, path: &Path) -> std::io::Result<Option<u64>> {
    let old = size(path);
    match std::fs::remove_file(path) {
        Ok(()) => sync_dir(dir).map(|()| old),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(e),
    }
}

/// Whether `name` is a temporary file [`replace`] may have left behind.
pub fn is_temporary(name: &str) -> bool {
    name.ends_with(TEMPORARY)
}

/// Makes a rename or removal in `dir` durable.
///
/// # Errors
/// As `open(2)` and `fsync(2)`.
pub fn sync_dir(dir: &Path) -> std::io::Result<()> {
    File::open(dir)?.sync_all()
}

/// Whether the entry at `path` is a symbolic link (`false` when there is none).
pub fn is_link(path: &Path) -> bool {
    std::fs::symlink_metadata(path).is_ok_and(|m| m.file_type().is_symlink())
}

fn nofollow() -> i32 {
    // The flag's bits fit an i32 (open(2) takes an int).
    i32::try_from((rustix::fs::OFlags::NOFOLLOW | rustix::fs::OFlags::CLOEXEC).bits()).unwrap_or(0)
}

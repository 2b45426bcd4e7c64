//! Node-local storage: a per-node operator's progress records and diff-base kept in files on
//! its node instead of on the shared objects.
//!
//! In per-node mode every node keeps its own state. On the objects, that state grows with the
//! number of nodes (the 256 KiB annotation limit is reached at a few hundred), costs one PATCH
//! per node and change, and every such PATCH reaches every node's watch. A DaemonSet's pod can
//! keep it on its node's disk instead (a hostPath): the state then lives and dies with the
//! node, which is exactly the lifetime of the node's operator.
//!
//! The engine does not know the difference. Before a cycle, [`NodeStore::overlay`] puts the
//! stored annotations into the body it processes, as if they were on the object; when the
//! cycle's changes are written, [`NodeStore::detach`] takes every key under the node's prefix
//! out of the PATCH and [`NodeStore::persist`] writes them to the object's file after the API
//! accepted the rest — a crash in between runs a finished handler again (kopf's checkpoint
//! window), never loses a handler's patch.
//!
//! One file per object (`<uid>.json`), replaced atomically: written to a temporary file,
//! fsynced, renamed, and the directory fsynced. A file that does not parse or whose checksum
//! does not match is reported and treated as "not handled yet" for that object only.
//!
//! A file that exists but cannot be read (permissions, an I/O error, something else in its
//! place) is not a missing one: its object was handled, and treating it as new would run its
//! create handlers again. Such an object is not processed at all until its file can be read
//! again; it is retried with a growing delay ([`NodeStore::retry_delay`]), reported and counted
//! (`capstan_node_storage_read_errors_total`).

use std::{
    collections::{HashMap, HashSet},
    path::{Path, PathBuf},
    sync::atomic::{AtomicU64, Ordering},
    time::{Duration, SystemTime},
};

use parking_lot::Mutex;

use blake2::{
    Blake2bVar,
    digest::{Update, VariableOutput},
};
use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};
use tracing::{debug, warn};

use super::keys::Keys;

pub mod claim;
mod files;

/// The largest state kept for one object: what the object's annotations could hold.
pub const ENTRY_LIMIT: usize = 256 * 1024;

/// How long a starting controller waits for another process (a surge pod of the same
/// DaemonSet) to release the store.
const LOCK_WAIT: Duration = Duration::from_secs(120);

/// The first and the longest delay before an object whose state cannot be read is tried again.
const UNREADABLE_RETRY: (Duration, Duration) = (Duration::from_secs(1), Duration::from_secs(30));

/// Errors of the node-local store.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The directory cannot be created or written.
    #[error("the node-local storage directory {path} is not usable")]
    Directory {
        /// The directory.
        path: PathBuf,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// Writing or removing an object's file failed.
    #[error("cannot write the node-local state of object {uid}")]
    Io {
        /// The object.
        uid: String,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// An object's state is larger than [`ENTRY_LIMIT`].
    #[error("the node-local state of object {uid} is {size} bytes, more than the {ENTRY_LIMIT} allowed")]
    TooLarge {
        /// The object.
        uid: String,
        /// Its size.
        size: usize,
    },
    /// The store is at its size limit.
    #[error("the node-local storage is full ({used} of {limit} bytes); object {uid} is not recorded")]
    Full {
        /// The object.
        uid: String,
        /// Bytes in use.
        used: u64,
        /// The limit.
        limit: u64,
    },
    /// The directory is another release's, overlaps one, or is reached through a link.
    #[error(transparent)]
    Claim(#[from] claim::Error),
    /// A uid that cannot be a file name.
    #[error("object uid {0:?} cannot name a file")]
    BadUid(String),
    /// An object's file exists but cannot be read: its object is not processed (it was handled,
    /// and its records are in that file) until it can.
    #[error("cannot read the node-local state of object {uid} from {path}")]
    Unreadable {
        /// The object.
        uid: String,
        /// Its file.
        path: PathBuf,
        /// Why.
        #[source]
        source: std::io::Error,
    },
}

/// Where the node-local storage is, whose it is and how large it may grow (`--node-storage`,
/// `--node-storage-claim`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Spec {
    /// The directory (a hostPath on the node).
    pub dir: PathBuf,
    /// The most bytes of state kept.
    pub limit: u64,
    /// The release the directory belongs to (see [`claim`]); unclaimed without one.
    pub claim: Option<String>,
}

impl Spec {
    /// Parses `file:<absolute directory>`.
    ///
    /// # Errors
    /// A message saying what the value should look like.
    pub fn parse(value: &str, limit: u64) -> Result<Self, String> {
        match value.strip_prefix("file:") {
            Some(dir) if dir.starts_with('/') => Ok(Self {
                dir: PathBuf::from(dir),
                limit,
                claim: None,
            }),
            _ => Err(format!(
                "--node-storage takes file:<absolute directory> (for example file:/var/lib/capstan/<namespace>/<release>), not {value:?}"
            )),
        }
    }
}

/// One object's file.
#[derive(Serialize, Deserialize)]
struct Entry {
    /// The resource (`plural.version.group`), for the garbage collection.
    resource: String,
    /// The object's namespace and name, for people reading the directory.
    #[serde(default)]
    namespace: String,
    #[serde(default)]
    name: String,
    /// The annotations under the node's prefix.
    annotations: Map<String, Value>,
    /// A checksum of `annotations` (BLAKE2b, hex).
    sum: String,
}

/// An object's state that could not be written yet.
#[derive(Debug, Clone)]
struct Unwritten {
    resource: String,
    body: Value,
    annotations: Map<String, Value>,
    /// The writes that failed in a row.
    failures: u32,
}

/// The node-local store of one controller: a directory per persistence prefix under the
/// given one, held with an exclusive lock while the controller runs.
#[derive(Debug)]
pub struct NodeStore {
    dir: PathBuf,
    keys: Keys,
    limit: u64,
    bytes: AtomicU64,
    entries: AtomicU64,
    corrupt: AtomicU64,
    /// Objects that still carry records of the node on themselves (written before the store
    /// was used): their next write removes them from the object.
    migrating: Mutex<HashSet<String>>,
    /// Objects whose file could not be read, with the reads that failed in a row.
    unreadable: Mutex<HashMap<String, u32>>,
    /// Objects whose latest state could not be written: kept here, and preferred to their
    /// files, until a retry writes it (their handlers ran; the old file would run them again).
    unwritten: Mutex<HashMap<String, Unwritten>>,
    /// The lock on the directory, held for the store's lifetime.
    _lock: std::fs::File,
}

impl NodeStore {
    /// Opens the store of the annotations `keys` owns under `spec`'s directory: claims that
    /// directory for `spec`'s release (when it names one), then the directory
    /// `<dir>/<prefix>` (created, mode 0700), locked against other processes (waiting up to
    /// two minutes for a previous pod to let go: off the runtime, so the admin endpoint
    /// answers probes meanwhile), with at most `spec.limit` bytes in use; counts what is
    /// there and removes temporary files a crash left behind.
    ///
    /// # Errors
    /// [`Error::Claim`] when the directory is another release's, overlaps one or is reached
    /// through a link; [`Error::Directory`] when it cannot be created, read, written or
    /// locked.
    pub async fn open(spec: &Spec, keys: Keys) -> Result<Self, Error> {
        let dir = spec.dir.join(&keys.prefix);
        let directory = |source| Error::Directory {
            path: dir.clone(),
            source,
        };
        let claimed = {
            let (spec, dir) = (spec.clone(), dir.clone());
            blocking(move || Self::claimed(&spec, &dir)).await
        };
        let mut lock = claimed?;
        const STEP: Duration = Duration::from_millis(500);
        let mut waited = Duration::ZERO;
        loop {
            let (file, attempt) = blocking(move || {
                let attempt = lock.try_lock();
                Ok((lock, attempt))
            })
            .await?;
            lock = file;
            match attempt {
                Ok(()) => break,
                Err(std::fs::TryLockError::WouldBlock) if waited < LOCK_WAIT => {
                    if waited.is_zero() {
                        warn!(dir = %dir.display(), "another process holds the node-local storage; waiting for it to exit");
                    }
                    tokio::time::sleep(STEP).await;
                    waited += STEP;
                }
                Err(std::fs::TryLockError::WouldBlock) => {
                    return Err(directory(std::io::Error::new(
                        std::io::ErrorKind::WouldBlock,
                        format!("another process has held it for {} s", LOCK_WAIT.as_secs()),
                    )));
                }
                Err(std::fs::TryLockError::Error(e)) => return Err(directory(e)),
            }
        }
        let limit = spec.limit;
        blocking(move || Self::opened(&dir, keys, limit, lock)).await
    }

    /// Claims `spec`'s directory, creates the prefix's directory `dir` in it and opens (not
    /// locks) its lock file.
    fn claimed(spec: &Spec, dir: &Path) -> Result<std::fs::File, Error> {
        if let Some(name) = &spec.claim {
            claim::claim(&spec.dir, name)?;
        }
        let directory = |source| Error::Directory {
            path: dir.to_owned(),
            source,
        };
        std::fs::create_dir_all(dir).map_err(directory)?;
        if let Some(link) = dir.ancestors().find(|p| files::is_link(p)) {
            return Err(claim::Error::Linked {
                path: link.to_owned(),
            }
            .into());
        }
        files::open_or_create(&dir.join(".lock")).map_err(directory)
    }

    /// The store of the locked directory `dir`.
    fn opened(dir: &Path, keys: Keys, limit: u64, lock: std::fs::File) -> Result<Self, Error> {
        let directory = |source| Error::Directory {
            path: dir.to_owned(),
            source,
        };
        #[cfg(unix)]
        {
            use std::os::unix::fs::PermissionsExt as _;
            std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o700)).map_err(directory)?;
        }
        let store = Self {
            dir: dir.to_owned(),
            keys,
            limit,
            bytes: AtomicU64::new(0),
            entries: AtomicU64::new(0),
            corrupt: AtomicU64::new(0),
            migrating: Mutex::default(),
            unreadable: Mutex::default(),
            unwritten: Mutex::default(),
            _lock: lock,
        };
        let (mut bytes, mut entries) = (0, 0);
        for item in std::fs::read_dir(dir).map_err(directory)? {
            let item = item.map_err(directory)?;
            let path = item.path();
            let name = item.file_name();
            let name = name.to_string_lossy();
            let file = item.file_type().is_ok_and(|t| t.is_file());
            if files::is_temporary(&name) {
                debug!(path = %path.display(), "removing a temporary file a crash left behind");
                let _ = std::fs::remove_file(&path);
            } else if file && name.ends_with(".json") {
                entries += 1;
                bytes += item.metadata().map(|m| m.len()).unwrap_or(0);
            }
        }
        // Proves the directory is writable before any handler runs.
        files::replace(dir, &dir.join(".probe"), b"", true).map_err(directory)?;
        files::remove(dir, &dir.join(".probe")).map_err(directory)?;
        store.bytes.store(bytes, Ordering::Relaxed);
        store.entries.store(entries, Ordering::Relaxed);
        Ok(store)
    }

    /// Bytes in use.
    pub fn bytes(&self) -> u64 {
        self.bytes.load(Ordering::Relaxed)
    }

    /// Objects with a file.
    pub fn entries(&self) -> u64 {
        self.entries.load(Ordering::Relaxed)
    }

    /// Files found corrupt since start.
    pub fn corrupt(&self) -> u64 {
        self.corrupt.load(Ordering::Relaxed)
    }

    fn path(&self, uid: &str) -> Result<PathBuf, Error> {
        let valid =
            !uid.is_empty() && uid.len() <= 128 && uid.chars().all(|c| c.is_ascii_alphanumeric() || c == '-');
        if valid {
            Ok(self.dir.join(format!("{uid}.json")))
        } else {
            Err(Error::BadUid(uid.to_owned()))
        }
    }

    /// The stored annotations of object `uid`; empty when there are none, or when its file is
    /// corrupt (reported, and then that object is handled as if it was never handled).
    ///
    /// # Errors
    /// [`Error::Unreadable`] when its file exists but cannot be read (the object must not be
    /// processed: see [`Self::retry_delay`]).
    pub fn load(&self, uid: &str) -> Result<Map<String, Value>, Error> {
        let Ok(path) = self.path(uid) else {
            return Ok(Map::new());
        };
        let text = match files::read(&path) {
            Ok(text) => text,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                self.readable(uid);
                return Ok(Map::new());
            }
            Err(source) => {
                crate::observability::metrics::global().node_storage_read_error();
                *self.unreadable.lock().entry(uid.to_owned()).or_default() += 1;
                return Err(Error::Unreadable {
                    uid: uid.to_owned(),
                    path,
                    source,
                });
            }
        };
        self.readable(uid);
        Ok(match serde_json::from_slice::<Entry>(&text) {
            Ok(entry) if entry.sum == checksum(&entry.annotations) => entry.annotations,
            Ok(_) => self.reject(uid, &path, "its checksum does not match"),
            Err(e) => self.reject(uid, &path, &e.to_string()),
        })
    }

    /// Object `uid`'s file was read (or is missing): its next failure starts the delays anew.
    fn readable(&self, uid: &str) {
        let mut unreadable = self.unreadable.lock();
        if !unreadable.is_empty() {
            unreadable.remove(uid);
        }
    }

    /// How long to wait before object `uid`, whose file could not be read, is tried again: 1 s
    /// after the first failure, doubling with every failure in a row, at most 30 s.
    pub fn retry_delay(&self, uid: &str) -> Duration {
        let unreadable = self.unreadable.lock().get(uid).copied().unwrap_or(1);
        let unwritten = self.unwritten.lock().get(uid).map_or(1, |u| u.failures);
        let failures = unreadable.max(unwritten);
        let (first, most) = UNREADABLE_RETRY;
        first
            .saturating_mul(1 << failures.saturating_sub(1).min(16))
            .min(most)
    }

    fn reject(&self, uid: &str, path: &Path, why: &str) -> Map<String, Value> {
        self.corrupt.fetch_add(1, Ordering::Relaxed);
        warn!(%uid, path = %path.display(), why, "the node-local state of this object is corrupt; it is handled as if it was never handled");
        Map::new()
    }

    /// Puts object `uid`'s stored annotations into `body`, as if they were on the object.
    ///
    /// An object that still carries records of this node on itself (handled before the store
    /// was used) keeps them when the store has none for it — the state is taken over — and its
    /// next write removes them from the object. When the store has records, they win.
    ///
    /// # Errors
    /// [`Error::Unreadable`] when the object's file cannot be read; `body` is left as it was.
    pub async fn overlay(&self, uid: &str, body: &mut Value) -> Result<(), Error> {
        // A state not written yet is the object's state: written now, or the object waits.
        let stored = match self.flush(uid).await? {
            Some(state) => state,
            // One small file, usually in the page cache: read in place.
            None => self.load(uid)?,
        };
        let Some(meta) = body.get_mut("metadata").and_then(Value::as_object_mut) else {
            return Ok(());
        };
        let annotations = meta
            .entry("annotations")
            .or_insert_with(|| Value::Object(Map::new()));
        let Some(annotations) = annotations.as_object_mut() else {
            return Ok(());
        };
        let request = format!("{}/{}", self.keys.prefix, super::retry::NAME);
        let on_object = annotations.keys().any(|k| self.keys.owns(k) && *k != request);
        if on_object {
            self.migrating.lock().insert(uid.to_owned());
        }
        if stored.is_empty() {
            return Ok(());
        }
        annotations.retain(|k, _| !self.keys.owns(k) || *k == request);
        annotations.extend(stored);
        Ok(())
    }

    /// Puts the node's records of `from` into `to` (another body of the same object), in
    /// place of those `to` has: for a body read again, when the store cannot be read for it.
    pub fn carry(&self, from: &Value, to: &mut Value) {
        let records = self.detach(&mut from.clone());
        self.detach(to);
        if records.is_empty() {
            return;
        }
        let Some(meta) = to.get_mut("metadata").and_then(Value::as_object_mut) else {
            return;
        };
        if let Some(annotations) = meta
            .entry("annotations")
            .or_insert_with(|| Value::Object(Map::new()))
            .as_object_mut()
        {
            annotations.extend(records);
        }
    }

    /// Whether object `uid` still carries this node's records on itself (see [`Self::overlay`]).
    pub fn migrating(&self, uid: &str) -> bool {
        self.migrating.lock().contains(uid)
    }

    /// Object `uid`'s records are off the object now.
    pub fn migrated(&self, uid: &str) {
        self.migrating.lock().remove(uid);
    }

    /// Takes the annotations under the node's prefix out of `body` and returns them.
    pub fn detach(&self, body: &mut Value) -> Map<String, Value> {
        let Some(annotations) = body
            .pointer_mut("/metadata/annotations")
            .and_then(Value::as_object_mut)
        else {
            return Map::new();
        };
        // A retry request (`capstan retry`) is written to the object by people and removed
        // from it by the controller: it stays on the object.
        let request = format!("{}/{}", self.keys.prefix, super::retry::NAME);
        let ours: Vec<String> = annotations
            .keys()
            .filter(|k| self.keys.owns(k) && **k != request)
            .cloned()
            .collect();
        ours.into_iter()
            .filter_map(|k| annotations.remove(&k).map(|v| (k, v)))
            .collect()
    }

    /// Replaces object `uid`'s state with `annotations` (removing its file when empty),
    /// atomically and durably.
    ///
    /// A state that cannot be written is kept in memory and preferred to the file by
    /// [`Self::overlay`], which writes it again (the object is not processed until it is
    /// written: see [`Self::unwritten`] and [`Self::retry_delay`]).
    ///
    /// # Errors
    /// [`Error::TooLarge`], [`Error::Full`] or [`Error::Io`]; the file then keeps the previous
    /// state.
    pub async fn persist(
        &self,
        uid: &str,
        resource: &str,
        body: &Value,
        annotations: Map<String, Value>,
    ) -> Result<(), Error> {
        let kept = annotations.clone();
        let written = self.write(uid, resource, body, annotations).await;
        match &written {
            Ok(()) => {
                self.unwritten.lock().remove(uid);
            }
            Err(Error::BadUid(_)) => {}
            Err(_) => {
                let meta = body.get("metadata").cloned().unwrap_or(Value::Null);
                let mut unwritten = self.unwritten.lock();
                let failures = unwritten.get(uid).map_or(0, |u| u.failures) + 1;
                unwritten.insert(
                    uid.to_owned(),
                    Unwritten {
                        resource: resource.to_owned(),
                        body: serde_json::json!({ "metadata": meta }),
                        annotations: kept,
                        failures,
                    },
                );
            }
        }
        written
    }

    /// Whether object `uid` has a state not written yet: it must not be processed until
    /// [`Self::overlay`] writes it.
    pub fn unwritten(&self, uid: &str) -> bool {
        self.unwritten.lock().contains_key(uid)
    }

    /// Writes object `uid`'s state not written yet, if it has one; that state when written.
    async fn flush(&self, uid: &str) -> Result<Option<Map<String, Value>>, Error> {
        let Some(pending) = self.unwritten.lock().get(uid).cloned() else {
            return Ok(None);
        };
        self.persist(uid, &pending.resource, &pending.body, pending.annotations.clone())
            .await?;
        debug!(%uid, "the node-local state not written before is written now");
        Ok(Some(pending.annotations))
    }

    async fn write(
        &self,
        uid: &str,
        resource: &str,
        body: &Value,
        annotations: Map<String, Value>,
    ) -> Result<(), Error> {
        let path = self.path(uid)?;
        if annotations.is_empty() {
            return self.remove(uid).await;
        }
        let meta = |k: &str| {
            body.pointer(&format!("/metadata/{k}"))
                .and_then(Value::as_str)
                .unwrap_or_default()
                .to_owned()
        };
        let entry = Entry {
            resource: resource.to_owned(),
            namespace: meta("namespace"),
            name: meta("name"),
            sum: checksum(&annotations),
            annotations,
        };
        let text = serde_json::to_vec(&entry).unwrap_or_default();
        if text.len() > ENTRY_LIMIT {
            return Err(Error::TooLarge {
                uid: uid.to_owned(),
                size: text.len(),
            });
        }
        let used = self.bytes();
        let old = files::size(&path).unwrap_or(0);
        if used.saturating_sub(old) + text.len() as u64 > self.limit {
            return Err(Error::Full {
                uid: uid.to_owned(),
                used,
                limit: self.limit,
            });
        }
        let dir = self.dir.clone();
        let owned_uid = uid.to_owned();
        let written = tokio::task::spawn_blocking(move || files::replace(&dir, &path, &text, true))
            .await
            .map_err(|e| std::io::Error::other(e.to_string()))
            .and_then(|r| r);
        match written {
            Ok((old, new)) => {
                self.account(old, Some(new));
                Ok(())
            }
            Err(source) => Err(Error::Io {
                uid: owned_uid,
                source,
            }),
        }
    }

    /// Removes object `uid`'s file (the object is gone).
    ///
    /// # Errors
    /// [`Error::Io`] when the file exists but cannot be removed.
    pub async fn remove(&self, uid: &str) -> Result<(), Error> {
        let path = self.path(uid)?;
        let dir = self.dir.clone();
        let removed = tokio::task::spawn_blocking(move || files::remove(&dir, &path))
            .await
            .map_err(|e| std::io::Error::other(e.to_string()))
            .and_then(|r| r);
        match removed {
            Ok(old) => {
                self.account(old, None);
                self.unwritten.lock().remove(uid);
                Ok(())
            }
            Err(source) => Err(Error::Io {
                uid: uid.to_owned(),
                source,
            }),
        }
    }

    fn account(&self, old: Option<u64>, new: Option<u64>) {
        match (old, new) {
            (None, Some(n)) => {
                self.entries.fetch_add(1, Ordering::Relaxed);
                self.bytes.fetch_add(n, Ordering::Relaxed);
            }
            (Some(o), None) => {
                let _ = self
                    .entries
                    .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |e| {
                        Some(e.saturating_sub(1))
                    });
                let _ = self
                    .bytes
                    .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |b| {
                        Some(b.saturating_sub(o))
                    });
            }
            (Some(o), Some(n)) => {
                let _ = self
                    .bytes
                    .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |b| {
                        Some(b.saturating_sub(o).saturating_add(n))
                    });
            }
            (None, None) => {}
        }
    }

    /// The uids with a file for `resource` last written before `before` (a file that cannot be
    /// read is left alone; a corrupt one, whose resource is unknown, goes with any resource).
    pub async fn uids(&self, resource: &str, before: SystemTime) -> Vec<String> {
        let (dir, resource) = (self.dir.clone(), resource.to_owned());
        tokio::task::spawn_blocking(move || files_of(&dir, &resource, before))
            .await
            .unwrap_or_default()
    }

    /// Removes the files of `resource`'s objects that are not in `live` (they no longer
    /// exist), among those last written before `before` (when the listing of `live` began: a
    /// file written since may belong to an object created after it); returns how many went.
    pub async fn retain(&self, resource: &str, live: &HashSet<String>, before: SystemTime) -> usize {
        let mut removed = 0;
        for uid in self.uids(resource, before).await {
            if live.contains(&uid) {
                continue;
            }
            match self.remove(&uid).await {
                Ok(()) => removed += 1,
                Err(e) => {
                    warn!(error = %crate::diagnostic::chain(&e), "removing the state of a gone object failed")
                }
            }
        }
        removed
    }
}

/// Claims `dir` for the release `claim` (when given; see [`claim`]), creates it (and its
/// parents) and gives it to `owner` (uid, gid) with mode 0711 (its claim readable by other
/// releases, its state not: each prefix's directory is 0700), for a controller that runs as
/// that user (`capstan prepare-storage`, run once as root). Only `dir` itself changes owner,
/// never a directory above it that other releases share.
///
/// # Errors
/// [`Error::Claim`] when the directory is another release's, overlaps one or is reached
/// through a link; [`Error::Directory`] when it cannot be created or changed.
pub fn prepare(dir: &Path, owner: (u32, u32), claim: Option<&str>) -> Result<(), Error> {
    let directory = |source| Error::Directory {
        path: dir.to_owned(),
        source,
    };
    match claim {
        Some(name) => claim::claim(dir, name)?,
        None => std::fs::create_dir_all(dir).map_err(directory)?,
    }
    if let Some(link) = dir.ancestors().find(|p| files::is_link(p)) {
        return Err(claim::Error::Linked {
            path: link.to_owned(),
        }
        .into());
    }
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt as _;
        std::os::unix::fs::lchown(dir, Some(owner.0), Some(owner.1)).map_err(directory)?;
        std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o711)).map_err(directory)?;
    }
    Ok(())
}

/// Runs `f` on the blocking pool: file-system calls never stall the runtime's threads.
async fn blocking<T: Send + 'static>(
    f: impl FnOnce() -> Result<T, Error> + Send + 'static,
) -> Result<T, Error> {
    tokio::task::spawn_blocking(f).await.unwrap_or_else(|e| {
        Err(Error::Directory {
            path: PathBuf::new(),
            source: std::io::Error::other(e.to_string()),
        })
    })
}

/// What [`NodeStore::uids`] lists, reading the directory `dir`.
fn files_of(dir: &Path, resource: &str, before: SystemTime) -> Vec<String> {
    let Ok(items) = std::fs::read_dir(dir) else {
        return Vec::new();
    };
    items
        .filter_map(Result::ok)
        .filter_map(|item| {
            let path = item.path();
            let uid = path.file_stem()?.to_str()?.to_owned();
            let named = uid.chars().all(|c| c.is_ascii_alphanumeric() || c == '-');
            (path.extension()? == "json" && named).then_some((uid, path))
        })
        .filter(|(_, path)| {
            std::fs::symlink_metadata(path)
                .and_then(|m| m.modified())
                .is_ok_and(|t| t < before)
        })
        .filter(|(_, path)| match files::read(path) {
            Ok(text) => serde_json::from_slice::<Entry>(&text).map_or(true, |e| e.resource == resource),
            Err(_) => false,
        })
        .map(|(uid, _)| uid)
        .collect()
}

fn checksum(annotations: &Map<String, Value>) -> String {
    let text = serde_json::to_vec(annotations).unwrap_or_default();
    let mut digest = [0u8; 16];
    if let Ok(mut hasher) = Blake2bVar::new(digest.len()) {
        hasher.update(&text);
        let _ = hasher.finalize_variable(&mut digest);
    }
    digest.iter().map(|b| format!("{b:02x}")).collect()
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    async fn store(dir: &Path, limit: u64) -> NodeStore {
        let spec = Spec {
            dir: dir.to_owned(),
            limit,
            claim: None,
        };
        NodeStore::open(&spec, Keys::new("node-a.capstan.dev"))
            .await
            .unwrap()
    }

    fn body() -> Value {
        json!({"metadata": {"name": "x", "namespace": "default", "uid": "u-1",
                            "annotations": {"team": "a", "node-a.capstan.dev/create_fn": "{}",
                                            "node-a.capstan.dev/last-handled-configuration": "{\"spec\":{}}\n"}}})
    }

    #[tokio::test]
    async fn state_round_trips_and_leaves_the_object() {
        let dir = tempfile::tempdir().unwrap();
        let s = store(dir.path(), 1 << 20).await;
        let mut b = body();
        b["metadata"]["annotations"]["node-a.capstan.dev/retry-request"] = json!("{}");
        let ours = s.detach(&mut b);
        assert_eq!(ours.len(), 2);
        assert!(
            b["metadata"]["annotations"]
                .get("node-a.capstan.dev/retry-request")
                .is_some(),
            "a retry request stays on the object"
        );
        b["metadata"]["annotations"]
            .as_object_mut()
            .map(|a| a.remove("node-a.capstan.dev/retry-request"));
        assert_eq!(
            b["metadata"]["annotations"],
            json!({"team": "a"}),
            "only foreign keys stay"
        );
        s.persist("u-1", "examples.v1.demo.capstan.dev", &b, ours.clone())
            .await
            .unwrap();
        assert_eq!((s.entries(), s.bytes() > 0), (1, true));
        let mut again = b.clone();
        s.overlay("u-1", &mut again).await.unwrap();
        assert_eq!(again, body());
        // A reopened store finds it (a restart).
        let entries = {
            // The store is locked while open: the first lets go before a second opens it.
            let copy = s.load("u-1").unwrap();
            assert_eq!(copy, ours);
            s.entries()
        };
        assert_eq!(entries, 1);
        s.persist("u-1", "examples.v1.demo.capstan.dev", &b, Map::new())
            .await
            .unwrap();
        assert_eq!((s.entries(), s.bytes()), (0, 0));
        assert!(s.load("u-1").unwrap().is_empty());
    }

    #[tokio::test]
    async fn records_on_the_object_are_taken_over_and_replacing_a_file_counts_its_old_size() {
        let dir = tempfile::tempdir().unwrap();
        let s = store(dir.path(), 1 << 20).await;
        // An object handled before the store: its records are kept, and marked for removal
        // from the object by its next write.
        let mut b = body();
        s.overlay("u-1", &mut b).await.unwrap();
        assert_eq!(b, body());
        assert!(s.migrating("u-1"));
        s.migrated("u-1");
        // With records in the store, the store's win.
        let mut stored = body();
        let mut ours = s.detach(&mut stored);
        ours.insert("node-a.capstan.dev/create_fn".into(), json!("{\"success\":true}"));
        s.persist("u-1", "r", &stored, ours.clone()).await.unwrap();
        let mut b = body();
        s.overlay("u-1", &mut b).await.unwrap();
        assert_eq!(
            b["metadata"]["annotations"]["node-a.capstan.dev/create_fn"],
            json!("{\"success\":true}")
        );
        // Near the limit, replacing a file is measured against what it replaces.
        let limit = s.bytes() + 10;
        drop(s);
        let s = store(dir.path(), limit).await;
        s.persist("u-1", "r", &stored, ours).await.unwrap();
    }

    #[tokio::test]
    async fn a_corrupt_file_affects_only_its_object() {
        let dir = tempfile::tempdir().unwrap();
        let s = store(dir.path(), 1 << 20).await;
        let mut b = body();
        let ours = s.detach(&mut b);
        for uid in ["u-1", "u-2", "u-3"] {
            s.persist(uid, "r", &b, ours.clone()).await.unwrap();
        }
        let text = std::fs::read(dir.path().join("node-a.capstan.dev/u-2.json")).unwrap();
        std::fs::write(
            dir.path().join("node-a.capstan.dev/u-2.json"),
            &text[..text.len() / 2],
        )
        .unwrap();
        let tampered =
            String::from_utf8(std::fs::read(dir.path().join("node-a.capstan.dev/u-3.json")).unwrap())
                .unwrap()
                .replace("create_fn", "create_fx");
        std::fs::write(dir.path().join("node-a.capstan.dev/u-3.json"), tampered).unwrap();
        assert_eq!(s.load("u-1").unwrap(), ours);
        assert!(s.load("u-2").unwrap().is_empty(), "truncated");
        assert!(s.load("u-3").unwrap().is_empty(), "checksum");
        assert_eq!(s.corrupt(), 2);
    }

    #[tokio::test]
    async fn an_unreadable_file_is_an_error_retried_with_growing_delays_not_an_empty_state() {
        let dir = tempfile::tempdir().unwrap();
        let s = store(dir.path(), 1 << 20).await;
        let mut b = body();
        let ours = s.detach(&mut b);
        s.persist("u-1", "r", &b, ours.clone()).await.unwrap();
        // Something else in the file's place: it cannot be read (also as root).
        let file = dir.path().join("node-a.capstan.dev/u-1.json");
        std::fs::remove_file(&file).unwrap();
        std::fs::create_dir(&file).unwrap();
        let mut seen = b.clone();
        for expected in [1, 2, 4, 8, 16, 30, 30] {
            assert!(matches!(
                s.overlay("u-1", &mut seen).await,
                Err(Error::Unreadable { .. })
            ));
            assert_eq!(s.retry_delay("u-1"), Duration::from_secs(expected));
        }
        assert_eq!(seen, b, "the body is left as it was");
        assert_eq!(s.corrupt(), 0, "not taken for a corrupt file");
        assert!(
            !s.uids("r", SystemTime::now() + Duration::from_secs(5))
                .await
                .contains(&"u-1".to_owned())
        );
        std::fs::remove_dir(&file).unwrap();
        s.persist("u-1", "r", &b, ours.clone()).await.unwrap();
        assert_eq!(s.load("u-1").unwrap(), ours);
        assert_eq!(
            s.retry_delay("u-1"),
            Duration::from_secs(1),
            "the delays start anew"
        );
        // A body read again gets the cycle's records when the store cannot give them.
        let mut fresh = b.clone();
        fresh["metadata"]["annotations"]["node-a.capstan.dev/stale"] = json!("x");
        s.carry(&body(), &mut fresh);
        assert_eq!(fresh, body());
    }

    #[tokio::test]
    async fn a_state_that_cannot_be_written_is_kept_and_written_before_its_object_is_processed() {
        let dir = tempfile::tempdir().unwrap();
        let s = store(dir.path(), 1 << 20).await;
        let mut b = body();
        let old = s.detach(&mut b);
        s.persist("u-1", "r", &b, old.clone()).await.unwrap();
        // Something in the file's place that a file cannot replace (also as root).
        let file = dir.path().join("node-a.capstan.dev/u-1.json");
        std::fs::remove_file(&file).unwrap();
        std::fs::create_dir(&file).unwrap();
        let mut new = old.clone();
        new.insert("node-a.capstan.dev/update_fn".into(), json!("{\"success\":true}"));
        assert!(matches!(
            s.persist("u-1", "r", &b, new.clone()).await,
            Err(Error::Io { .. })
        ));
        assert!(s.unwritten("u-1"));
        // While it cannot be written, the object is not processed, with growing delays.
        let mut seen = b.clone();
        for expected in [2, 4, 8] {
            assert!(s.overlay("u-1", &mut seen).await.is_err());
            assert_eq!(s.retry_delay("u-1"), Duration::from_secs(expected));
        }
        assert_eq!(seen, b, "the body is left as it was");
        // Once it can be, the state not written is written and is the object's state.
        std::fs::remove_dir(&file).unwrap();
        s.overlay("u-1", &mut seen).await.unwrap();
        assert_eq!(
            seen["metadata"]["annotations"]["node-a.capstan.dev/update_fn"],
            json!("{\"success\":true}")
        );
        assert!(!s.unwritten("u-1"));
        assert_eq!(s.load("u-1").unwrap(), new);
        assert_eq!(s.retry_delay("u-1"), Duration::from_secs(1));
        // A state too large is kept as well; a gone object's is dropped.
        let big: Map<String, Value> = [("node-a.capstan.dev/x".to_owned(), json!("y".repeat(ENTRY_LIMIT)))]
            .into_iter()
            .collect();
        assert!(s.persist("u-1", "r", &b, big).await.is_err());
        assert!(s.unwritten("u-1"));
        s.remove("u-1").await.unwrap();
        assert!(!s.unwritten("u-1"));
    }

    #[tokio::test]
    async fn links_planted_in_the_node_local_store_are_never_followed() {
        let dir = tempfile::tempdir().unwrap();
        let s = store(dir.path(), 1 << 20).await;
        let mut b = body();
        let ours = s.detach(&mut b);
        s.persist("u-1", "r", &b, ours.clone()).await.unwrap();
        let store_dir = dir.path().join("node-a.capstan.dev");
        // Someone else's file, with valid state in it, and a link to it in place of a state file.
        let elsewhere = dir.path().join("elsewhere.json");
        std::fs::copy(store_dir.join("u-1.json"), &elsewhere).unwrap();
        let before = std::fs::read(&elsewhere).unwrap();
        std::os::unix::fs::symlink(&elsewhere, store_dir.join("u-2.json")).unwrap();
        // Not read through: an unreadable entry (its object waits), not the other file's state.
        assert!(matches!(s.load("u-2"), Err(Error::Unreadable { .. })));
        assert!(
            !s.uids("r", SystemTime::now() + Duration::from_secs(5))
                .await
                .contains(&"u-2".to_owned()),
            "nor listed through"
        );
        // Not written through: the link is replaced, its target unchanged.
        let small: Map<String, Value> = [("node-a.capstan.dev/x".to_owned(), json!("y"))]
            .into_iter()
            .collect();
        s.persist("u-2", "r", &b, small.clone()).await.unwrap();
        assert_eq!(
            std::fs::read(&elsewhere).unwrap(),
            before,
            "the target was written"
        );
        assert!(
            !std::fs::symlink_metadata(store_dir.join("u-2.json"))
                .unwrap()
                .is_symlink()
        );
        assert_eq!(s.load("u-2").unwrap(), small);
        // Not removed through: the link goes, its target stays.
        std::os::unix::fs::symlink(&elsewhere, store_dir.join("u-3.json")).unwrap();
        s.remove("u-3").await.unwrap();
        assert!(elsewhere.exists() && !store_dir.join("u-3.json").exists());
        // A temporary file of a crash that is a link: removed as a link at the next start.
        std::os::unix::fs::symlink(&elsewhere, store_dir.join(".x.tmp")).unwrap();
        drop(s);
        let s = store(dir.path(), 1 << 20).await;
        assert!(elsewhere.exists() && !files::is_link(&store_dir.join(".x.tmp")));
        // A lock file or a store directory that is a link: refused.
        drop(s);
        std::fs::remove_file(store_dir.join(".lock")).unwrap();
        std::os::unix::fs::symlink(&elsewhere, store_dir.join(".lock")).unwrap();
        let spec = Spec {
            dir: dir.path().to_owned(),
            limit: 1 << 20,
            claim: None,
        };
        assert!(
            NodeStore::open(&spec, Keys::new("node-a.capstan.dev"))
                .await
                .is_err()
        );
        assert_eq!(std::fs::read(&elsewhere).unwrap(), before);
        let other = tempfile::tempdir().unwrap();
        std::os::unix::fs::symlink(other.path(), dir.path().join("node-b.capstan.dev")).unwrap();
        assert!(matches!(
            NodeStore::open(&spec, Keys::new("node-b.capstan.dev")).await,
            Err(Error::Claim(claim::Error::Linked { .. }))
        ));
    }

    #[tokio::test]
    async fn a_held_store_is_waited_for_without_stalling_the_runtime() {
        let dir = tempfile::tempdir().unwrap();
        let first = store(dir.path(), 1 << 20).await;
        let path = dir.path().to_owned();
        // One runtime thread: the wait must leave it free for others (the admin endpoint).
        let second = tokio::spawn(async move { store(&path, 1 << 20).await });
        let mut ticks = 0;
        while ticks < 10 {
            tokio::time::sleep(Duration::from_millis(100)).await;
            ticks += 1;
            assert!(!second.is_finished(), "opened while held");
        }
        drop(first);
        let second = tokio::time::timeout(Duration::from_secs(5), second)
            .await
            .expect("opened once let go")
            .unwrap();
        assert_eq!(second.entries(), 0);
    }

    #[tokio::test]
    async fn sizes_are_bounded_and_gone_objects_are_collected() {
        let dir = tempfile::tempdir().unwrap();
        let s = store(dir.path(), 600).await;
        let b = body();
        let big: Map<String, Value> = [("node-a.capstan.dev/x".to_owned(), json!("y".repeat(ENTRY_LIMIT)))]
            .into_iter()
            .collect();
        assert!(matches!(
            s.persist("u-1", "r", &b, big).await,
            Err(Error::TooLarge { .. })
        ));
        let small: Map<String, Value> = [("node-a.capstan.dev/x".to_owned(), json!("y"))]
            .into_iter()
            .collect();
        s.persist("u-1", "r", &b, small.clone()).await.unwrap();
        s.persist("u-2", "r", &b, small.clone()).await.unwrap();
        s.persist("u-3", "other", &b, small.clone()).await.unwrap();
        let mut n = 4;
        while s.persist(&format!("u-{n}"), "r", &b, small.clone()).await.is_ok() {
            n += 1;
        }
        assert!(s.bytes() <= 600, "{}", s.bytes());
        assert!(matches!(
            s.persist("u-99", "r", &b, small.clone()).await,
            Err(Error::Full { .. })
        ));
        let live: HashSet<String> = ["u-1".to_owned()].into();
        let later = SystemTime::now() + Duration::from_secs(5);
        assert_eq!(
            s.retain("r", &live, SystemTime::UNIX_EPOCH).await,
            0,
            "files written after the listing began stay"
        );
        assert_eq!(s.retain("r", &live, later).await, n - 2 - 1);
        assert_eq!(s.load("u-1").unwrap(), small);
        assert_eq!(s.load("u-3").unwrap(), small, "another resource's objects stay");
        assert!(matches!(
            s.persist("../x", "r", &b, small).await,
            Err(Error::BadUid(_))
        ));
    }
}

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

use std::{
    collections::HashSet,
    io::Write as _,
    path::{Path, PathBuf},
    sync::atomic::{AtomicU64, Ordering},
};

use blake2::{
    Blake2bVar,
    digest::{Update, VariableOutput},
};
use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};
use tracing::{debug, warn};

use super::keys::Keys;

/// The largest state kept for one object: what the object's annotations could hold.
pub const ENTRY_LIMIT: usize = 256 * 1024;

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
    /// A uid that cannot be a file name.
    #[error("object uid {0:?} cannot name a file")]
    BadUid(String),
}

/// Where the node-local storage is and how large it may grow (`--node-storage`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Spec {
    /// The directory (a hostPath on the node).
    pub dir: PathBuf,
    /// The most bytes of state kept.
    pub limit: u64,
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
            }),
            _ => Err(format!(
                "--node-storage takes file:<absolute directory> (for example file:/var/lib/capstan), not {value:?}"
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

/// The node-local store of one controller.
#[derive(Debug)]
pub struct NodeStore {
    dir: PathBuf,
    keys: Keys,
    limit: u64,
    bytes: AtomicU64,
    entries: AtomicU64,
    corrupt: AtomicU64,
}

impl NodeStore {
    /// Opens (creating it, mode 0700) the directory `dir` for the annotations `keys` owns, with
    /// at most `limit` bytes in use; counts what is there and removes temporary files a crash
    /// left behind.
    ///
    /// # Errors
    /// [`Error::Directory`] when it cannot be created, read or written.
    pub fn open(dir: &Path, keys: Keys, limit: u64) -> Result<Self, Error> {
        let directory = |source| Error::Directory {
            path: dir.to_owned(),
            source,
        };
        std::fs::create_dir_all(dir).map_err(directory)?;
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
        };
        let (mut bytes, mut entries) = (0, 0);
        for item in std::fs::read_dir(dir).map_err(directory)? {
            let item = item.map_err(directory)?;
            let path = item.path();
            match path.extension().and_then(|e| e.to_str()) {
                Some("json") => {
                    entries += 1;
                    bytes += item.metadata().map(|m| m.len()).unwrap_or(0);
                }
                Some("tmp") => {
                    debug!(path = %path.display(), "removing a temporary file a crash left behind");
                    let _ = std::fs::remove_file(&path);
                }
                _ => {}
            }
        }
        // Proves the directory is writable before any handler runs.
        let probe = dir.join(".probe.tmp");
        std::fs::write(&probe, b"").map_err(directory)?;
        let _ = std::fs::remove_file(&probe);
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
    pub fn load(&self, uid: &str) -> Map<String, Value> {
        let Ok(path) = self.path(uid) else {
            return Map::new();
        };
        let text = match std::fs::read(&path) {
            Ok(text) => text,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Map::new(),
            Err(e) => {
                warn!(%uid, error = %e, "cannot read the node-local state; the object is handled as new");
                return Map::new();
            }
        };
        match serde_json::from_slice::<Entry>(&text) {
            Ok(entry) if entry.sum == checksum(&entry.annotations) => entry.annotations,
            Ok(_) => self.reject(uid, &path, "its checksum does not match"),
            Err(e) => self.reject(uid, &path, &e.to_string()),
        }
    }

    fn reject(&self, uid: &str, path: &Path, why: &str) -> Map<String, Value> {
        self.corrupt.fetch_add(1, Ordering::Relaxed);
        warn!(%uid, path = %path.display(), why, "the node-local state of this object is corrupt; it is handled as if it was never handled");
        Map::new()
    }

    /// Puts object `uid`'s stored annotations into `body`, as if they were on the object.
    pub fn overlay(&self, uid: &str, body: &mut Value) {
        let stored = self.load(uid);
        if stored.is_empty() {
            return;
        }
        if let Some(meta) = body.get_mut("metadata").and_then(Value::as_object_mut) {
            let annotations = meta
                .entry("annotations")
                .or_insert_with(|| Value::Object(Map::new()));
            if let Some(annotations) = annotations.as_object_mut() {
                annotations.extend(stored);
            }
        }
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
    /// # Errors
    /// [`Error::TooLarge`], [`Error::Full`] or [`Error::Io`]; the previous state is then kept.
    pub async fn persist(
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
        if used + text.len() as u64 > self.limit {
            return Err(Error::Full {
                uid: uid.to_owned(),
                used,
                limit: self.limit,
            });
        }
        let dir = self.dir.clone();
        let owned_uid = uid.to_owned();
        let written = tokio::task::spawn_blocking(move || replace(&dir, &path, &text))
            .await
            .map_err(|e| std::io::Error::other(e.to_string()))
            .and_then(|r| r);
        match written {
            Ok((old, new)) => {
                self.account(old, new);
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
        let removed = tokio::task::spawn_blocking(move || {
            let old = std::fs::metadata(&path).map(|m| m.len()).ok();
            match std::fs::remove_file(&path) {
                Ok(()) => sync_dir(&dir).map(|()| old),
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
                Err(e) => Err(e),
            }
        })
        .await
        .map_err(|e| std::io::Error::other(e.to_string()))
        .and_then(|r| r);
        match removed {
            Ok(old) => {
                self.account(old, None);
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

    /// The uids with a file for `resource`.
    pub fn uids(&self, resource: &str) -> Vec<String> {
        let Ok(items) = std::fs::read_dir(&self.dir) else {
            return Vec::new();
        };
        items
            .filter_map(Result::ok)
            .filter_map(|item| {
                let path = item.path();
                let uid = path.file_stem()?.to_str()?.to_owned();
                (path.extension()? == "json").then_some((uid, path))
            })
            .filter(|(_, path)| {
                std::fs::read(path)
                    .ok()
                    .and_then(|t| serde_json::from_slice::<Entry>(&t).ok())
                    // A corrupt file's resource is unknown: it goes with any resource's sweep.
                    .is_none_or(|e| e.resource == resource)
            })
            .map(|(uid, _)| uid)
            .collect()
    }

    /// Removes the files of `resource`'s objects that are not in `live` (they no longer
    /// exist); returns how many went.
    pub async fn retain(&self, resource: &str, live: &HashSet<String>) -> usize {
        let mut removed = 0;
        for uid in self.uids(resource) {
            if live.contains(&uid) {
                continue;
            }
            match self.remove(&uid).await {
                Ok(()) => removed += 1,
                Err(e) => {
                    warn!(error = %crate::error::chain(&e), "removing the state of a gone object failed")
                }
            }
        }
        removed
    }
}

/// Creates `dir` (and its parents) and gives it to `owner` (uid, gid) with mode 0700, for a
/// controller that runs as that user (`capstan prepare-storage`, run once as root).
///
/// # Errors
/// [`Error::Directory`] when it cannot be created or changed.
pub fn prepare(dir: &Path, owner: (u32, u32)) -> Result<(), Error> {
    let directory = |source| Error::Directory {
        path: dir.to_owned(),
        source,
    };
    std::fs::create_dir_all(dir).map_err(directory)?;
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt as _;
        std::os::unix::fs::chown(dir, Some(owner.0), Some(owner.1)).map_err(directory)?;
        std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o700)).map_err(directory)?;
    }
    Ok(())
}

/// Replaces `path` with `text` durably; returns the old and new sizes.
fn replace(dir: &Path, path: &Path, text: &[u8]) -> std::io::Result<(Option<u64>, Option<u64>)> {
    let old = std::fs::metadata(path).map(|m| m.len()).ok();
    let tmp = path.with_extension("tmp");
    {
        let mut file = std::fs::File::create(&tmp)?;
        file.write_all(text)?;
        file.sync_all()?;
    }
    std::fs::rename(&tmp, path)?;
    sync_dir(dir)?;
    Ok((old, Some(text.len() as u64)))
}

/// Makes a rename or removal in `dir` durable.
fn sync_dir(dir: &Path) -> std::io::Result<()> {
    std::fs::File::open(dir)?.sync_all()
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

    fn store(dir: &Path, limit: u64) -> NodeStore {
        NodeStore::open(dir, Keys::new("node-a.capstan.dev"), limit).unwrap()
    }

    fn body() -> Value {
        json!({"metadata": {"name": "x", "namespace": "default", "uid": "u-1",
                            "annotations": {"team": "a", "node-a.capstan.dev/create_fn": "{}",
                                            "node-a.capstan.dev/last-handled-configuration": "{\"spec\":{}}\n"}}})
    }

    #[tokio::test]
    async fn state_round_trips_and_leaves_the_object() {
        let dir = tempfile::tempdir().unwrap();
        let s = store(dir.path(), 1 << 20);
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
        s.overlay("u-1", &mut again);
        assert_eq!(again, body());
        // A reopened store finds it (a restart).
        let reopened = store(dir.path(), 1 << 20);
        assert_eq!(reopened.load("u-1"), ours);
        assert_eq!(reopened.entries(), 1);
        s.persist("u-1", "examples.v1.demo.capstan.dev", &b, Map::new())
            .await
            .unwrap();
        assert_eq!((s.entries(), s.bytes()), (0, 0));
        assert!(s.load("u-1").is_empty());
    }

    #[tokio::test]
    async fn a_corrupt_file_affects_only_its_object() {
        let dir = tempfile::tempdir().unwrap();
        let s = store(dir.path(), 1 << 20);
        let mut b = body();
        let ours = s.detach(&mut b);
        for uid in ["u-1", "u-2", "u-3"] {
            s.persist(uid, "r", &b, ours.clone()).await.unwrap();
        }
        let text = std::fs::read(dir.path().join("u-2.json")).unwrap();
        std::fs::write(dir.path().join("u-2.json"), &text[..text.len() / 2]).unwrap();
        let tampered = String::from_utf8(std::fs::read(dir.path().join("u-3.json")).unwrap())
            .unwrap()
            .replace("create_fn", "create_fx");
        std::fs::write(dir.path().join("u-3.json"), tampered).unwrap();
        assert_eq!(s.load("u-1"), ours);
        assert!(s.load("u-2").is_empty(), "truncated");
        assert!(s.load("u-3").is_empty(), "checksum");
        assert_eq!(s.corrupt(), 2);
    }

    #[tokio::test]
    async fn sizes_are_bounded_and_gone_objects_are_collected() {
        let dir = tempfile::tempdir().unwrap();
        let s = store(dir.path(), 600);
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
        assert_eq!(s.retain("r", &live).await, n - 2 - 1);
        assert_eq!(s.load("u-1"), small);
        assert_eq!(s.load("u-3"), small, "another resource's objects stay");
        assert!(matches!(
            s.persist("../x", "r", &b, small).await,
            Err(Error::BadUid(_))
        ));
    }
}

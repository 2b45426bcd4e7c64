//! Which release a node-local storage directory belongs to.
//!
//! Every release of the chart keeps its per-node state under a hostPath. Two releases that
//! share a directory, or one whose directory lies inside another's, would read, garbage-collect
//! and re-own each other's files (the prepare step gives the directory to its release's user:
//! a second release with another user would lock the first one out). So a directory is
//! claimed: a file `.capstan-claim` in it names the release (`--node-storage-claim`, the
//! chart's `<namespace>/<release>`), written by the first to use it. A directory claimed by
//! another release is refused, and so is one inside a claimed directory or around one (a
//! claim below it), and one reached through a symbolic link (anyone who can write on the node
//! could redirect it). The claim is readable by everyone (its directory is traversable, the
//! state below it is not), so that other releases see it.

use std::path::{Path, PathBuf};

use super::files;

/// The claim file's name, in the claimed directory.
pub const FILE: &str = ".capstan-claim";

/// How deep below a directory other claims are looked for.
const DEPTH: usize = 4;

/// Errors of claiming a directory.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// Another release claimed the directory.
    #[error(
        "the node-local storage directory {dir} belongs to {owner:?}, not to {claim:?}: releases cannot share it; give this one a directory of its own (the chart's default is /var/lib/capstan/<namespace>/<release>)"
    )]
    Taken {
        /// The directory.
        dir: PathBuf,
        /// Whose it is.
        owner: String,
        /// Who asked.
        claim: String,
    },
    /// The directory is inside one another release claimed.
    #[error(
        "the node-local storage directory {dir} is inside {other}, which belongs to {owner:?}: releases cannot share storage; give this one a directory outside it"
    )]
    Inside {
        /// The directory.
        dir: PathBuf,
        /// The claimed directory around it.
        other: PathBuf,
        /// Whose that is.
        owner: String,
    },
    /// The directory contains one another release claimed.
    #[error(
        "the node-local storage directory {dir} contains {other}, which belongs to {owner:?}: releases cannot share storage; give this one a directory of its own beside it"
    )]
    Around {
        /// The directory.
        dir: PathBuf,
        /// The claimed directory below it.
        other: PathBuf,
        /// Whose that is.
        owner: String,
    },
    /// The directory or its claim is reached through a symbolic link.
    #[error(
        "{path} is a symbolic link: node-local storage is never reached through links (anyone who can write on the node could redirect it); name the real directory"
    )]
    Linked {
        /// The link.
        path: PathBuf,
    },
    /// The directory is not absolute, or the claim's name is unusable.
    #[error("{0}")]
    Invalid(String),
    /// The directory or its claim cannot be read or written.
    #[error("cannot check or write the claim of {path}")]
    Io {
        /// The path.
        path: PathBuf,
        /// Why.
        #[source]
        source: std::io::Error,
    },
}

/// Claims `dir` for `name` (creating it): refused when another release claimed it, when it is
/// inside or around another claimed directory, or when it or one of its parents is a link.
/// Claiming a directory again for the same name changes nothing.
///
/// # Errors
/// What is wrong, as [`Error`] says.
pub fn claim(dir: &Path, name: &str) -> Result<(), Error> {
    check_name(name)?;
    if !dir.is_absolute() {
        return Err(Error::Invalid(format!(
            "the node-local storage directory {} is not absolute",
            dir.display()
        )));
    }
    no_links(dir)?;
    for other in dir.ancestors().skip(1) {
        if let Some(owner) = owner(other)?
            && owner != name
        {
            return Err(Error::Inside {
                dir: dir.to_owned(),
                other: other.to_owned(),
                owner,
            });
        }
    }
    let io = |source| Error::Io {
        path: dir.to_owned(),
        source,
    };
    std::fs::create_dir_all(dir).map_err(io)?;
    // Created meanwhile by someone else as a link?
    no_links(dir)?;
    below(dir, dir, name, DEPTH)?;
    match owner(dir)? {
        Some(owner) if owner == name => Ok(()),
        Some(owner) => Err(Error::Taken {
            dir: dir.to_owned(),
            owner,
            claim: name.to_owned(),
        }),
        None => {
            let text = format!("{name}\n");
            match files::replace(dir, &dir.join(FILE), text.as_bytes(), false) {
                Ok(_) => {}
                // Claimed at the same moment: whose is it?
                Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {
                    return match owner(dir)? {
                        Some(owner) if owner == name => Ok(()),
                        owner => Err(Error::Taken {
                            dir: dir.to_owned(),
                            owner: owner.unwrap_or_default(),
                            claim: name.to_owned(),
                        }),
                    };
                }
                Err(e) => return Err(io(e)),
            }
            set_mode(&dir.join(FILE), 0o644).map_err(io)
        }
    }
}

/// The name a claim must be: one line of letters, digits and `-._/:` (a namespace, a release).
fn check_name(name: &str) -> Result<(), Error> {
    let valid = !name.is_empty()
        && name.len() <= 512
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || "-._/:".contains(c));
    if valid {
        Ok(())
    } else {
        Err(Error::Invalid(format!(
            "{name:?} cannot name a node-local storage claim: use letters, digits and -._/: (the chart uses <namespace>/<release>)"
        )))
    }
}

/// Refuses `dir` when it, or a directory it is in, is a symbolic link.
fn no_links(dir: &Path) -> Result<(), Error> {
    match dir.ancestors().find(|p| files::is_link(p)) {
        Some(link) => Err(Error::Linked {
            path: link.to_owned(),
        }),
        None => Ok(()),
    }
}

/// Who claimed `dir`, if anyone (a claim that is a link is refused).
fn owner(dir: &Path) -> Result<Option<String>, Error> {
    let path = dir.join(FILE);
    match files::read(&path) {
        Ok(text) => Ok(Some(String::from_utf8_lossy(&text).trim().to_owned())),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        // A directory that cannot be entered holds no claim this process could see; the one
        // that can enter it checks it.
        Err(e) if e.kind() == std::io::ErrorKind::PermissionDenied => Ok(None),
        Err(_) if files::is_link(&path) => Err(Error::Linked { path }),
        Err(source) => Err(Error::Io { path, source }),
    }
}

/// Refuses `top` when a directory below `dir` (at most `depth` levels) is claimed by another
/// than `name`. Links are not followed; a directory that cannot be listed is not searched
/// (its own claim is still read when it can be).
fn below(top: &Path, dir: &Path, name: &str, depth: usize) -> Result<(), Error> {
    if depth == 0 {
        return Ok(());
    }
    let Ok(items) = std::fs::read_dir(dir) else {
        return Ok(());
    };
    for item in items.filter_map(Result::ok) {
        if !item.file_type().is_ok_and(|t| t.is_dir()) {
            continue;
        }
        let sub = item.path();
        if let Some(owner) = owner(&sub)? {
            if owner != name {
                return Err(Error::Around {
                    dir: top.to_owned(),
                    other: sub,
                    owner,
                });
            }
            continue;
        }
        // A store's own directory (it holds the lock) has only state files below it.
        if sub.join(".lock").exists() {
            continue;
        }
        below(top, &sub, name, depth - 1)?;
    }
    Ok(())
}

fn set_mode(path: &Path, mode: u32) -> std::io::Result<()> {
    use std::os::unix::fs::PermissionsExt as _;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_directory_is_one_releases_and_overlapping_or_linked_ones_are_refused() {
        let root = tempfile::tempdir().unwrap();
        let shared = root.path().join("capstan");
        let a = shared.join("ops/a");
        claim(&a, "ops/a").unwrap();
        assert_eq!(
            std::fs::read_to_string(a.join(FILE)).unwrap(),
            "ops/a\n",
            "the claim names the release"
        );
        claim(&a, "ops/a").expect("claimed again by the same release");
        // Another release in the same directory.
        let e = claim(&a, "ops/b").unwrap_err();
        assert!(
            matches!(e, Error::Taken { ref owner, .. } if owner == "ops/a"),
            "{e}"
        );
        assert!(e.to_string().contains("belongs to \"ops/a\""), "{e}");
        // Beside it: fine.
        claim(&shared.join("ops/b"), "ops/b").unwrap();
        // Inside it.
        let e = claim(&a.join("nested"), "ops/c").unwrap_err();
        assert!(matches!(e, Error::Inside { ref other, .. } if *other == a), "{e}");
        // Around it (the shared root of every release).
        let e = claim(&shared, "ops/c").unwrap_err();
        assert!(matches!(e, Error::Around { .. }), "{e}");
        assert!(!shared.join(FILE).exists(), "a refused claim writes nothing");
        // Through a link, to the directory or to one above it.
        let link = root.path().join("link");
        std::os::unix::fs::symlink(&a, &link).unwrap();
        let e = claim(&link, "ops/a").unwrap_err();
        assert!(matches!(e, Error::Linked { ref path } if *path == link), "{e}");
        let up = root.path().join("up");
        std::os::unix::fs::symlink(&shared, &up).unwrap();
        assert!(matches!(
            claim(&up.join("ops/d"), "ops/d"),
            Err(Error::Linked { .. })
        ));
        // A claim that is a link to another's claim.
        let planted = root.path().join("planted");
        std::fs::create_dir(&planted).unwrap();
        std::os::unix::fs::symlink(a.join(FILE), planted.join(FILE)).unwrap();
        assert!(matches!(claim(&planted, "ops/a"), Err(Error::Linked { .. })));
        // Names and paths that cannot be claims.
        assert!(matches!(claim(&shared.join("x"), "a\nb"), Err(Error::Invalid(_))));
        assert!(matches!(
            claim(Path::new("relative"), "ops/x"),
            Err(Error::Invalid(_))
        ));
    }
}

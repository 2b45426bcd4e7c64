//! Names of everything Capstan stores on objects: progress annotation keys, the diff-base key,
//! the finalizer, and how long handler ids are shortened to fit Kubernetes' limits.
//!
//! Key mangling follows kopf exactly so that kopf-compatible mode can read and write kopf's
//! records: `/` becomes `.`, `<` and `>` become `_`, and a name part longer than 63 characters
//! is truncated and given a stable suffix: `-` and the URL-ish base64 (`-` and `.` as the extra
//! characters) of a 4-byte BLAKE2b digest. Two formats exist: V2 limits the name part to 63
//! characters; legacy V1 counted the prefix too. Both are read; both are written while
//! `v1` is on (they coincide for short ids).
//!
//! Handler ids are free text on the wire, and kopf's substitutions do not make every id a
//! valid annotation name (a space, a colon or a trailing `_` stay, and the API server would
//! refuse the key — kopf's operator fails there). Capstan accepts such ids and goes one step
//! further only for them: every character outside `[A-Za-z0-9._-]` becomes `_`, leading
//! non-alphanumerics are dropped, and the stable suffix of the original id is always added, so
//! that the key is valid and never collides with another id's (`has space` →
//! `has_space-<digest>`, while `has_space` stays as it is). Ids that kopf stores validly keep
//! kopf's keys exactly.

use blake2::{
    Blake2bVar,
    digest::{Update, VariableOutput},
};

/// The longest name part of an annotation key.
pub const NAME_LIMIT: usize = 63;

/// kopf's annotation prefix.
pub const KOPF_PREFIX: &str = "kopf.zalando.org";

/// kopf's finalizer (`settings.persistence.finalizer`), whatever the storages' prefix.
pub const KOPF_FINALIZER: &str = "kopf.zalando.org/KopfFinalizerMarker";

/// The naming scheme of one controller's stored state.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Keys {
    /// The annotation prefix (a DNS subdomain), e.g. `capstan.dev`.
    pub prefix: String,
    /// Also write legacy V1 keys (kopf's default).
    pub v1: bool,
    /// The diff-base annotation key, e.g. `capstan.dev/last-handled-configuration`.
    pub diffbase: String,
    /// The finalizer name, e.g. `capstan.dev/finalizer`.
    pub finalizer: String,
}

impl Keys {
    /// Capstan's defaults under `prefix`.
    pub fn new(prefix: &str) -> Self {
        Self {
            prefix: prefix.to_owned(),
            v1: false,
            diffbase: format!("{prefix}/last-handled-configuration"),
            finalizer: format!("{prefix}/finalizer"),
        }
    }

    /// kopf's names: prefix `kopf.zalando.org`, V1 keys written, kopf's finalizer.
    pub fn kopf() -> Self {
        Self::kopf_under(KOPF_PREFIX)
    }

    /// kopf's names under another prefix, as a kopf operator configured with
    /// `AnnotationsProgressStorage(prefix=…)` and `AnnotationsDiffBaseStorage(prefix=…)` uses
    /// them: V1 keys written, `<prefix>/last-handled-configuration`, and kopf's finalizer
    /// (which kopf configures apart from the storages).
    pub fn kopf_under(prefix: &str) -> Self {
        Self {
            v1: true,
            finalizer: KOPF_FINALIZER.to_owned(),
            ..Self::new(prefix)
        }
    }

    /// The V2 key of a handler's progress record.
    pub fn v2_key(&self, id: &str) -> String {
        let safe = safe(id);
        if !valid_name(&safe) {
            return format!("{}/{}", self.prefix, repaired(id, &safe, NAME_LIMIT));
        }
        if id.len() > NAME_LIMIT {
            let suffix = suffix(id);
            format!(
                "{}/{}{suffix}",
                self.prefix,
                truncate(&safe, NAME_LIMIT.saturating_sub(suffix.len()))
            )
        } else {
            format!("{}/{safe}", self.prefix)
        }
    }

    /// The legacy V1 key of a handler's progress record.
    pub fn v1_key(&self, id: &str) -> String {
        let safe = safe(id);
        let room = NAME_LIMIT.saturating_sub(self.prefix.len() + 1);
        if !valid_name(&safe) {
            return format!("{}/{}", self.prefix, repaired(id, &safe, room));
        }
        if safe.len() <= room {
            format!("{}/{safe}", self.prefix)
        } else {
            let suffix = suffix(&safe);
            format!(
                "{}/{}{suffix}",
                self.prefix,
                truncate(&safe, room.saturating_sub(suffix.len()))
            )
        }
    }

    /// Keys to read, in order of preference (V2 first), deduplicated.
    pub fn read_keys(&self, id: &str) -> Vec<String> {
        let v2 = self.v2_key(id);
        let v1 = self.v1_key(id);
        if v1 == v2 { vec![v2] } else { vec![v2, v1] }
    }

    /// Keys to write: V2, and V1 too when `v1` is on.
    pub fn write_keys(&self, id: &str) -> Vec<String> {
        let v2 = self.v2_key(id);
        let v1 = self.v1_key(id);
        if self.v1 && v1 != v2 {
            vec![v2, v1]
        } else {
            vec![v2]
        }
    }

    /// Whether an annotation key belongs to this controller's storage (progress, diff-base or
    /// markers).
    pub fn owns(&self, annotation: &str) -> bool {
        annotation.split_once('/').is_some_and(|(p, _)| p == self.prefix)
    }
}

fn safe(id: &str) -> String {
    id.chars()
        .map(|c| match c {
            '/' => '.',
            '<' | '>' => '_',
            c => c,
        })
        .collect()
}

fn allowed(c: char) -> bool {
    c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.')
}

/// Whether kopf's safe form of an id makes a valid annotation name (once shortened, when it
/// is too long: the digest suffix then ends it).
fn valid_name(safe: &str) -> bool {
    safe.chars().next().is_some_and(|c| c.is_ascii_alphanumeric())
        && safe.chars().all(allowed)
        && (safe.len() > NAME_LIMIT || safe.ends_with(|c: char| c.is_ascii_alphanumeric()))
}

/// A valid name for an id whose safe form is not one: see the module docs.
fn repaired(id: &str, safe: &str, room: usize) -> String {
    let cleaned: String = safe.chars().map(|c| if allowed(c) { c } else { '_' }).collect();
    let cleaned = cleaned.trim_start_matches(|c: char| !c.is_ascii_alphanumeric());
    let cleaned = if cleaned.is_empty() { "h" } else { cleaned };
    let suffix = suffix(id);
    format!("{}{suffix}", truncate(cleaned, room.saturating_sub(suffix.len())))
}

fn truncate(s: &str, max: usize) -> &str {
    let mut end = max.min(s.len());
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    &s[..end]
}

/// kopf's stable suffix: `-` + base64 (altchars `-.`) of a 4-byte BLAKE2b digest, with
/// trailing `=`, `-` and `.` stripped.
pub fn suffix(key: &str) -> String {
    let mut digest = [0u8; 4];
    if let Ok(mut hasher) = Blake2bVar::new(4) {
        hasher.update(key.as_bytes());
        let _ = hasher.finalize_variable(&mut digest);
    }
    let encoded = base64(&digest);
    format!("-{}", encoded.trim_end_matches(['=', '-', '.']))
}

fn base64(bytes: &[u8]) -> String {
    const ALPHABET: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-.";
    let mut out = String::new();
    for chunk in bytes.chunks(3) {
        let b = [chunk[0], *chunk.get(1).unwrap_or(&0), *chunk.get(2).unwrap_or(&0)];
        let n = (u32::from(b[0]) << 16) | (u32::from(b[1]) << 8) | u32::from(b[2]);
        for i in 0..4 {
            if i <= chunk.len() {
                out.push(ALPHABET[((n >> (18 - 6 * i)) & 63) as usize] as char);
            } else {
                out.push('=');
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn short_ids_are_made_safe() {
        let k = Keys::kopf();
        assert_eq!(k.v2_key("create_fn"), "kopf.zalando.org/create_fn");
        assert_eq!(
            k.v2_key("update_fn/spec.field"),
            "kopf.zalando.org/update_fn.spec.field"
        );
        assert_eq!(k.write_keys("create_fn").len(), 1);
    }

    #[test]
    fn long_ids_match_kopf() {
        let k = Keys::kopf();
        let id = "x".repeat(70);
        assert_eq!(
            k.v1_key(&id),
            format!("kopf.zalando.org/{}-j8bZbQ", "x".repeat(39))
        );
        assert_eq!(
            k.v2_key(&id),
            format!("kopf.zalando.org/{}-j8bZbQ", "x".repeat(56))
        );
        assert_eq!(k.write_keys(&id).len(), 2);
        assert_eq!(Keys::new("capstan.dev").write_keys(&id).len(), 1);
    }

    #[test]
    fn kopf_names_keep_the_finalizer_under_any_prefix() {
        let k = Keys::kopf();
        assert_eq!(k.diffbase, "kopf.zalando.org/last-handled-configuration");
        assert_eq!(k.finalizer, "kopf.zalando.org/KopfFinalizerMarker");
        assert!(k.v1);
        let custom = Keys::kopf_under("my-op.example.com");
        assert_eq!(custom.diffbase, "my-op.example.com/last-handled-configuration");
        assert_eq!(custom.finalizer, KOPF_FINALIZER);
        assert!(custom.v1);
    }

    #[test]
    fn names_never_exceed_the_limit() {
        let k = Keys::new("capstan.dev");
        for len in [1, 62, 63, 64, 200] {
            let key = k.v2_key(&"a/b<c>".repeat(len));
            assert!(key.split_once('/').unwrap().1.len() <= NAME_LIMIT, "{key}");
        }
    }

    #[test]
    fn ids_that_are_no_valid_names_are_repaired_without_collisions() {
        let k = Keys::new("capstan.dev");
        let valid = |key: &str| {
            let name = key.split_once('/').map_or("", |(_, n)| n);
            !name.is_empty()
                && name.len() <= NAME_LIMIT
                && name.chars().all(allowed)
                && name.starts_with(|c: char| c.is_ascii_alphanumeric())
                && name.ends_with(|c: char| c.is_ascii_alphanumeric())
        };
        let spaced = k.v2_key("has space");
        assert!(spaced.starts_with("capstan.dev/has_space-"), "{spaced}");
        assert_ne!(spaced, k.v2_key("has_space"));
        assert_eq!(k.v2_key("has_space"), "capstan.dev/has_space");
        for id in [
            "has space",
            "fn_",
            "_private",
            "ns:name",
            "ünï",
            "***",
            &"a b".repeat(40),
        ] {
            for key in [k.v2_key(id), k.v1_key(id)] {
                assert!(valid(&key), "{id:?} -> {key:?}");
            }
        }
    }

    #[test]
    fn ownership_is_by_prefix() {
        let k = Keys::new("capstan.dev");
        assert!(k.owns("capstan.dev/create_fn"));
        assert!(!k.owns("node-1.capstan.dev/create_fn"));
        assert!(!k.owns("kopf.zalando.org/create_fn"));
    }
}

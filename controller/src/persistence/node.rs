//! Per-node identity: the storage prefix of an operator running on one node of a DaemonSet.
//!
//! Every node's operator keeps its own progress, diff-base and finalizer on the same objects,
//! so its prefix carries the node's name: `<node>.<prefix>` by default, or another layout from a
//! template (`{prefix}.{node_short}` takes over objects of kopf operators that built their
//! per-node prefixes by hand that way). Node names may be long or contain
//! characters that annotation keys do not allow; they are normalised to a DNS label
//! (lowercase letters, digits, `-`) and, whenever the name had to be changed or shortened,
//! given a stable hash suffix of the original name, so two different nodes never share a
//! prefix and a node always gets the same one. The result always satisfies Kubernetes' limits:
//! each label ≤ 63 characters and the whole prefix ≤ 253 (the name part after `/` is kept
//! within 63 by the key mangling of `keys`).

use blake2::{
    Blake2bVar,
    digest::{Update, VariableOutput},
};

/// The longest label used for a node name; leaves room under 63 for long base prefixes.
pub const NODE_LABEL_LIMIT: usize = 40;

/// The default layout of a per-node prefix: `<node>.<prefix>`.
pub const DEFAULT_TEMPLATE: &str = "{node}.{prefix}";

/// Checks a per-node prefix layout: `{prefix}` (the persistence prefix) and `{node}` (the node
/// name as a DNS label) or `{node_short}` (its first dot-separated part as a label), joined by
/// lowercase letters, digits, `-` and `.` — for example `{prefix}.{node_short}`, the layout
/// kopf operators built by hand (`example.com.node-1`).
///
/// # Errors
/// A message saying what is wrong with the template.
pub fn check_template(template: &str) -> Result<(), String> {
    if !template.contains("{prefix}") {
        return Err("the node prefix template needs {prefix}".into());
    }
    if !template.contains("{node}") && !template.contains("{node_short}") {
        return Err("the node prefix template needs {node} or {node_short}".into());
    }
    let rest = template
        .replace("{prefix}", "")
        .replace("{node_short}", "")
        .replace("{node}", "");
    if let Some(c) = rest
        .chars()
        .find(|c| !matches!(c, 'a'..='z' | '0'..='9' | '-' | '.'))
    {
        return Err(format!(
            "the node prefix template may join its placeholders only with lowercase letters, digits, '-' and '.', not {c:?}"
        ));
    }
    Ok(())
}

/// The per-node prefix for `node` under `base` laid out by `template` (see [`check_template`]);
/// the node's part is shortened (with a stable hash) when the result would exceed
/// Kubernetes' limits.
pub fn prefix_with(template: &str, node: &str, base: &str) -> String {
    if template == DEFAULT_TEMPLATE {
        return prefix(node, base);
    }
    let short = node.split('.').next().unwrap_or(node);
    let render = |node_label: &str, short_label: &str| {
        template
            .replace("{prefix}", base)
            .replace("{node_short}", short_label)
            .replace("{node}", node_label)
    };
    let (full, short_label) = (label(node), label(short));
    let rendered = render(&full, &short_label);
    if rendered.len() <= 253 {
        return rendered;
    }
    let fixed = render("", "").len();
    let budget = 253usize.saturating_sub(fixed).max(8);
    render(
        &shorten(node, &full, budget),
        &shorten(short, &short_label, budget),
    )
}

/// The per-node prefix for `node` under `base` (e.g. `node-1.capstan.dev`).
pub fn prefix(node: &str, base: &str) -> String {
    let label = label(node);
    let budget = 253usize.saturating_sub(base.len() + 1);
    let label = if label.len() > budget {
        shorten(node, &label, budget.max(8))
    } else {
        label
    };
    format!("{label}.{base}")
}

/// The node name as a DNS label: normalised, shortened, and hash-suffixed when altered.
pub fn label(node: &str) -> String {
    let normalised: String = node
        .chars()
        .map(|c| match c {
            'a'..='z' | '0'..='9' | '-' => c,
            'A'..='Z' => c.to_ascii_lowercase(),
            _ => '-',
        })
        .collect();
    let trimmed = normalised.trim_matches('-').to_owned();
    if trimmed == node && !trimmed.is_empty() && trimmed.len() <= NODE_LABEL_LIMIT {
        return trimmed;
    }
    shorten(node, &trimmed, NODE_LABEL_LIMIT)
}

/// `label` cut to fit `max` with `-<hash of node>` appended.
fn shorten(node: &str, label: &str, max: usize) -> String {
    let hash = hash(node);
    let room = max.saturating_sub(hash.len() + 1);
    let mut head: String = label.chars().take(room).collect();
    while head.ends_with('-') {
        head.pop();
    }
    if head.is_empty() {
        format!("n{hash}")
    } else {
        format!("{head}-{hash}")
    }
}

/// Eight lowercase base32 characters of a BLAKE2b digest of the node name.
fn hash(node: &str) -> String {
    let mut digest = [0u8; 5];
    if let Ok(mut hasher) = Blake2bVar::new(5) {
        hasher.update(node.as_bytes());
        let _ = hasher.finalize_variable(&mut digest);
    }
    const ALPHABET: &[u8; 32] = b"abcdefghijklmnopqrstuvwxyz234567";
    let bits = digest.iter().fold(0u64, |acc, b| (acc << 8) | u64::from(*b));
    (0..8)
        .rev()
        .map(|i| ALPHABET[((bits >> (i * 5)) & 31) as usize] as char)
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::persistence::Keys;

    fn valid_label(l: &str) -> bool {
        !l.is_empty()
            && l.len() <= 63
            && l.chars()
                .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-')
            && !l.starts_with('-')
            && !l.ends_with('-')
    }

    #[test]
    fn plain_node_names_are_kept() {
        assert_eq!(prefix("node-1", "capstan.dev"), "node-1.capstan.dev");
    }

    #[test]
    fn odd_and_long_names_are_normalised_with_a_stable_suffix() {
        let odd = prefix("Node_1.Example", "capstan.dev");
        let plain = prefix("node-1-example", "capstan.dev");
        assert_ne!(odd, plain, "different nodes never share a prefix");
        assert_eq!(odd, prefix("Node_1.Example", "capstan.dev"), "stable");
        let long = "x".repeat(300);
        for node in ["Node_1.Example", long.as_str(), "ü-node", "--", "a.b.c.d"] {
            let p = prefix(node, "capstan.dev");
            assert!(p.len() <= 253, "{p}");
            for l in p.split('.') {
                assert!(valid_label(l), "{node:?} -> {p}");
            }
            let keys = Keys::new(&p);
            let key = keys.v2_key(&"handler/with/a/long/id".repeat(5));
            assert!(key.split_once('/').is_some_and(|(_, n)| n.len() <= 63), "{key}");
            assert!(keys.finalizer.split_once('/').is_some_and(|(_, n)| n.len() <= 63));
        }
    }

    #[test]
    fn templates_lay_out_the_prefix_as_asked() {
        assert_eq!(
            prefix_with(DEFAULT_TEMPLATE, "node-1", "capstan.dev"),
            "node-1.capstan.dev"
        );
        assert_eq!(
            prefix_with(
                "{prefix}.{node_short}",
                "node-1.eu-west-1.compute.internal",
                "example.com"
            ),
            "example.com.node-1"
        );
        assert_eq!(
            prefix_with("{prefix}.{node}", "node-1", "example.com"),
            "example.com.node-1"
        );
        let long = prefix_with("{prefix}.{node}", &"n".repeat(300), "example.com");
        assert!(long.len() <= 253 && long.starts_with("example.com."), "{long}");
        for l in long.split('.') {
            assert!(valid_label(l), "{long}");
        }
        assert!(check_template("{prefix}.{node_short}").is_ok());
        assert!(check_template("my-op-{node}.{prefix}").is_ok());
        for bad in [
            "{node}",
            "{prefix}",
            "{node}/{prefix}",
            "{node}_{prefix}",
            "{NODE}.{prefix}",
        ] {
            assert!(check_template(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn long_base_prefixes_still_fit() {
        let base = format!("{}.example.com", "b".repeat(60));
        let p = prefix(&"n".repeat(100), &base);
        assert!(p.len() <= 253 && p.ends_with(&base));
    }
}

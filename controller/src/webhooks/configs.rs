//! The managed webhook configurations (kopf's `admission.managed`): one
//! `ValidatingWebhookConfiguration` and one `MutatingWebhookConfiguration`, built from the
//! accepted validate and mutate registrations.
//!
//! kopf writes one webhook per handler and lets the API server combine them; Capstan writes one
//! webhook per resource (and subresource; a `*` handler's webhook takes in those of single
//! subresources) and combines the handlers itself, so one request of a user costs one call to
//! the controller, however many handlers it has. Each webhook:
//!
//! - `rules`: the resource as discovery resolved it, with the union of the handlers'
//!   operations (`*` when one of them takes all), any scope;
//! - `failurePolicy: Ignore` only when every handler ignores failures (the controller applies
//!   each handler's own choice when it answers; the API server's policy covers an unreachable
//!   controller);
//! - `sideEffects: NoneOnDryRun` when a handler declared side effects, else `None` — dry-run
//!   requests reach the handlers in both cases, flagged as such;
//! - `namespaceSelector` from exact `--namespace` names (patterns cannot be expressed: then the
//!   controller's own namespace check is the only one), always excluding the namespaces given
//!   in `excluded_namespaces`, for namespaced resources only;
//! - `objectSelector` from the handlers' label filters when they all have the same ones;
//! - `clientConfig` with the Service (in a cluster) or the URL (development), the path of the
//!   phase, and the CA bundle;
//! - `timeoutSeconds`, `matchPolicy: Equivalent`, `admissionReviewVersions: [v1, v1beta1]`.
//!
//! Webhook names are `<plural>[-<subresource>].<group or "core">.<configuration name>`, made
//! valid DNS names.

use std::collections::{BTreeMap, BTreeSet};

use serde_json::{Value, json};

use super::admission::{Phase, ignores_failures};
use crate::model::{KindOptions, MetaMatch, Registration};

/// Where the API server reaches the webhook server.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Endpoint {
    /// A Service in the cluster.
    Service {
        /// Its namespace.
        namespace: String,
        /// Its name.
        name: String,
        /// Its port.
        port: u16,
    },
    /// A URL (`https://host:port`), for development outside a cluster.
    Url(String),
}

/// What the configurations are built from besides the registrations.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Layout {
    /// The name of both configurations.
    pub name: String,
    /// Where the webhook server is reached.
    pub endpoint: Endpoint,
    /// The PEM CA bundle.
    pub ca_bundle: Vec<u8>,
    /// `timeoutSeconds` (1–30).
    pub timeout_seconds: u8,
    /// Exact namespace names served (`None`: all, or patterns).
    pub namespaces: Option<Vec<String>>,
    /// Namespaces never sent to the webhooks (e.g. `kube-system`), so that a failing handler
    /// cannot lock the cluster out of them.
    pub excluded_namespaces: Vec<String>,
}

/// The configuration of `phase` built from `registrations` (other kinds are ignored).
pub fn build(phase: Phase, registrations: &[Registration], layout: &Layout) -> Value {
    let regs: Vec<&Registration> = registrations.iter().filter(|r| r.kind == phase.kind()).collect();
    let subresource_of = |reg: &Registration| match &reg.options {
        KindOptions::Admission(o) => o.subresource.clone(),
        _ => String::new(),
    };
    // A `*` handler's webhook (`<plural>/*`) covers every subresource: the handlers of one
    // subresource join it, or a write of that subresource would call the server twice and
    // run every handler twice.
    let every: BTreeSet<(&str, &str, &str)> = regs
        .iter()
        .filter(|reg| subresource_of(reg) == "*")
        .filter_map(|reg| reg.resource.as_ref())
        .map(|r| (r.group.as_str(), r.version.as_str(), r.plural.as_str()))
        .collect();
    let mut groups: BTreeMap<(String, String, String, String), Vec<&Registration>> = BTreeMap::new();
    for reg in regs {
        let Some(resource) = &reg.resource else { continue };
        let mut subresource = subresource_of(reg);
        if !subresource.is_empty()
            && every.contains(&(
                resource.group.as_str(),
                resource.version.as_str(),
                resource.plural.as_str(),
            ))
        {
            subresource = "*".to_owned();
        }
        groups
            .entry((
                resource.group.clone(),
                resource.version.clone(),
                resource.plural.clone(),
                subresource,
            ))
            .or_default()
            .push(reg);
    }
    let webhooks: Vec<Value> = groups
        .iter()
        .map(|((group, version, plural, subresource), regs)| {
            webhook(phase, layout, (group, version, plural, subresource), regs)
        })
        .collect();
    let kind = match phase {
        Phase::Validating => "ValidatingWebhookConfiguration",
        Phase::Mutating => "MutatingWebhookConfiguration",
    };
    json!({
        "apiVersion": "admissionregistration.k8s.io/v1",
        "kind": kind,
        "metadata": {
            "name": layout.name,
            "labels": {"app.kubernetes.io/managed-by": "capstan"},
        },
        "webhooks": webhooks,
    })
}

fn webhook(
    phase: Phase,
    layout: &Layout,
    (group, version, plural, subresource): (&String, &String, &String, &String),
    regs: &[&Registration],
) -> Value {
    let mut operations: Vec<String> = Vec::new();
    for reg in regs {
        let own = match &reg.options {
            KindOptions::Admission(o) => o.operations.clone(),
            _ => Vec::new(),
        };
        if own.is_empty() {
            operations = vec!["*".into()];
            break;
        }
        for op in own {
            if !operations.contains(&op) {
                operations.push(op);
            }
        }
    }
    let resource = if subresource.is_empty() {
        plural.clone()
    } else {
        format!("{plural}/{subresource}")
    };
    let path = format!("/{}", phase.as_str());
    let ca = serde_json::to_value(k8s_openapi::ByteString(layout.ca_bundle.clone())).unwrap_or_default();
    let client = match &layout.endpoint {
        Endpoint::Service {
            namespace,
            name,
            port,
        } => json!({
            "service": {"namespace": namespace, "name": name, "port": port, "path": path},
            "caBundle": ca,
        }),
        Endpoint::Url(base) => {
            json!({"url": format!("{}{path}", base.trim_end_matches('/')), "caBundle": ca})
        }
    };
    let side_effects = regs
        .iter()
        .any(|r| matches!(&r.options, KindOptions::Admission(o) if o.side_effects));
    let mut hook = json!({
        "name": webhook_name(plural, subresource, group, &layout.name),
        "clientConfig": client,
        "rules": [{
            "apiGroups": [group],
            "apiVersions": [version],
            "resources": [resource],
            "operations": operations,
            "scope": "*",
        }],
        "failurePolicy": if regs.iter().all(|r| ignores_failures(r)) { "Ignore" } else { "Fail" },
        "sideEffects": if side_effects { "NoneOnDryRun" } else { "None" },
        "matchPolicy": "Equivalent",
        "admissionReviewVersions": ["v1", "v1beta1"],
        "timeoutSeconds": layout.timeout_seconds.clamp(1, 30),
    });
    if phase == Phase::Mutating {
        hook["reinvocationPolicy"] = json!("Never");
    }
    let namespaced = regs
        .iter()
        .any(|r| r.resource.as_ref().is_some_and(|res| res.namespaced));
    if namespaced {
        let mut expressions = Vec::new();
        if let Some(names) = &layout.namespaces {
            expressions
                .push(json!({"key": "kubernetes.io/metadata.name", "operator": "In", "values": names}));
        }
        if !layout.excluded_namespaces.is_empty() {
            expressions.push(json!({"key": "kubernetes.io/metadata.name", "operator": "NotIn", "values": layout.excluded_namespaces}));
        }
        if !expressions.is_empty() {
            hook["namespaceSelector"] = json!({"matchExpressions": expressions});
        }
    }
    if let Some(selector) = object_selector(regs) {
        hook["objectSelector"] = selector;
    }
    hook
}

/// The label filters shared by every handler, as a label selector.
fn object_selector(regs: &[&Registration]) -> Option<Value> {
    let first = &regs.first()?.filters.labels;
    if first.is_empty() || regs.iter().any(|r| &r.filters.labels != first) {
        return None;
    }
    let expressions: Vec<Value> = first
        .iter()
        .map(|(key, m)| match m {
            MetaMatch::Equals(v) => json!({"key": key, "operator": "In", "values": [v]}),
            MetaMatch::Present => json!({"key": key, "operator": "Exists"}),
            MetaMatch::Absent => json!({"key": key, "operator": "DoesNotExist"}),
        })
        .collect();
    Some(json!({"matchExpressions": expressions}))
}

/// A valid webhook name (a DNS subdomain of at least three labels).
fn webhook_name(plural: &str, subresource: &str, group: &str, configuration: &str) -> String {
    let clean = |s: &str| -> String {
        let s: String = s
            .to_ascii_lowercase()
            .chars()
            .map(|c| {
                if c.is_ascii_alphanumeric() || c == '.' || c == '-' {
                    c
                } else {
                    '-'
                }
            })
            .collect();
        s.trim_matches(|c| c == '-' || c == '.').to_owned()
    };
    let mut first = clean(plural);
    if !subresource.is_empty() {
        // `*` (every subresource) cleans to nothing: named `all`.
        let sub = match clean(subresource) {
            s if s.is_empty() => "all".to_owned(),
            s => s,
        };
        first = format!("{first}-{sub}");
    }
    let group = if group.is_empty() {
        "core".to_owned()
    } else {
        clean(group)
    };
    let mut name = format!("{first}.{group}.{}", clean(configuration));
    name.truncate(253);
    name.trim_end_matches(['-', '.']).to_owned()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::{AdmissionOptions, HandlerKind, ResolvedResource};

    fn reg(id: &str, kind: HandlerKind, options: AdmissionOptions) -> Registration {
        let mut r = Registration::new(id, kind, None);
        r.resource = Some(ResolvedResource {
            group: "demo.capstan.dev".into(),
            version: "v1".into(),
            plural: "examples".into(),
            kind: "Example".into(),
            namespaced: true,
            status_subresource: false,
        });
        r.options = KindOptions::Admission(options);
        r
    }

    fn layout() -> Layout {
        Layout {
            name: "capstan-webhooks".into(),
            endpoint: Endpoint::Url("https://127.0.0.1:9443".into()),
            ca_bundle: b"PEM".to_vec(),
            timeout_seconds: 10,
            namespaces: Some(vec!["default".into()]),
            excluded_namespaces: vec!["kube-system".into()],
        }
    }

    #[test]
    fn one_webhook_per_resource_with_the_handlers_combined() {
        let mut a = reg(
            "a",
            HandlerKind::Validate,
            AdmissionOptions {
                operations: vec!["CREATE".into()],
                ignore_failures: true,
                ..AdmissionOptions::default()
            },
        );
        a.filters.labels.insert("team".into(), MetaMatch::Present);
        let mut b = reg(
            "b",
            HandlerKind::Validate,
            AdmissionOptions {
                operations: vec!["UPDATE".into(), "CREATE".into()],
                side_effects: true,
                ..AdmissionOptions::default()
            },
        );
        b.filters.labels.insert("team".into(), MetaMatch::Present);
        let m = reg("m", HandlerKind::Mutate, AdmissionOptions::default());
        let regs = vec![a, b, m];
        let config = build(Phase::Validating, &regs, &layout());
        assert_eq!(config["kind"], "ValidatingWebhookConfiguration");
        let hooks = config["webhooks"].as_array().expect("webhooks");
        assert_eq!(hooks.len(), 1);
        let hook = &hooks[0];
        assert_eq!(hook["name"], "examples.demo.capstan.dev.capstan-webhooks");
        assert_eq!(hook["rules"][0]["operations"], json!(["CREATE", "UPDATE"]));
        assert_eq!(hook["rules"][0]["resources"], json!(["examples"]));
        assert_eq!(hook["failurePolicy"], "Fail");
        assert_eq!(hook["sideEffects"], "NoneOnDryRun");
        assert_eq!(hook["clientConfig"]["url"], "https://127.0.0.1:9443/validate");
        assert_eq!(hook["clientConfig"]["caBundle"], "UEVN");
        assert_eq!(
            hook["objectSelector"]["matchExpressions"][0]["operator"],
            "Exists"
        );
        assert_eq!(
            hook["namespaceSelector"]["matchExpressions"][1],
            json!({"key": "kubernetes.io/metadata.name", "operator": "NotIn", "values": ["kube-system"]})
        );
        let mutating = build(Phase::Mutating, &regs, &layout());
        let hook = &mutating["webhooks"][0];
        assert_eq!(hook["rules"][0]["operations"], json!(["*"]));
        assert_eq!(hook["failurePolicy"], "Fail");
        assert_eq!(hook["reinvocationPolicy"], "Never");
        assert!(hook.get("objectSelector").is_none());
    }

    /// A status write is one call: the `status` handler's webhook joins the `*` one, whose
    /// rule covers it (two webhooks would both call, and every handler would run twice).
    #[test]
    fn the_webhook_of_every_subresource_takes_in_those_of_single_ones() {
        let sub = |id: &str, subresource: &str| {
            reg(
                id,
                HandlerKind::Validate,
                AdmissionOptions {
                    subresource: subresource.into(),
                    ..AdmissionOptions::default()
                },
            )
        };
        let regs = vec![sub("main", ""), sub("status", "status"), sub("any", "*")];
        let config = build(Phase::Validating, &regs, &layout());
        let hooks = config["webhooks"].as_array().expect("webhooks");
        let resources: Vec<&Value> = hooks.iter().map(|h| &h["rules"][0]["resources"]).collect();
        assert_eq!(
            resources,
            [&json!(["examples"]), &json!(["examples/*"])],
            "{hooks:?}"
        );
    }

    #[test]
    fn names_are_valid_and_services_are_addressed() {
        assert_eq!(
            webhook_name("pods", "status", "", "capstan"),
            "pods-status.core.capstan"
        );
        // kopf's `subresource='*'`: every subresource, in a valid name (not `examples-.…`,
        // which the API server refuses, and the configuration would be written again and
        // again).
        assert_eq!(
            webhook_name("examples", "*", "demo.capstan.dev", "capstan"),
            "examples-all.demo.capstan.dev.capstan"
        );
        let mut l = layout();
        l.endpoint = Endpoint::Service {
            namespace: "ops".into(),
            name: "capstan-webhook".into(),
            port: 443,
        };
        let regs = vec![reg("m", HandlerKind::Mutate, AdmissionOptions::default())];
        let config = build(Phase::Mutating, &regs, &l);
        assert_eq!(
            config["webhooks"][0]["clientConfig"]["service"],
            json!({"namespace": "ops", "name": "capstan-webhook", "port": 443, "path": "/mutate"})
        );
        assert_eq!(build(Phase::Validating, &regs, &l)["webhooks"], json!([]));
    }
}

//! kopf's `settings` that are the controller's work for the whole operator — where state is
//! persisted, how resources are watched, how many objects are processed at once — as handler
//! processes send them (`ProcessSettings.operator`).
//!
//! A kopf operator configures itself in a startup handler (`settings.persistence.finalizer =
//! …`). With Capstan that work is the controller's, so each value travels to it and is applied
//! as if its flag had been given. The rules that decide between sources live here, beside the
//! fields, so that the hub (which takes the values) and the engine (which applies them) agree:
//!
//! - a flag given to the controller wins over a setting (the operator's deployment is the
//!   last word, as a flag is in front of kopf's own defaults);
//! - between processes, for each field, the process connected first wins: a newcomer (a
//!   second handler container, a restarted one) cannot flip the finalizer of a running operator;
//! - a value stays in effect when its process leaves, until a process sends another: the
//!   restart of a handler container must not restart the engine twice, and a value that was
//!   overruled does not take over unasked when the process that set the first one leaves.

use std::{fmt, time::Duration};

/// Where handler progress records are kept (`--progress-storage`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ProgressKind {
    /// One annotation per handler.
    Annotations,
    /// Under `status.<field>.progress`.
    Status,
    /// Annotations, also reading the status.
    Smart,
}

/// Where the diff-base is kept (`--diffbase-storage`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DiffBaseKind {
    /// In one annotation.
    Annotations,
    /// Under `status.<field>.last-handled-configuration`.
    Status,
}

/// The operator-wide settings one process sent, or those in effect; `None` is "not set".
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct OperatorSettings {
    /// `persistence.finalizer`.
    pub finalizer: Option<String>,
    /// The annotations' prefix (`AnnotationsProgressStorage(prefix=…)`).
    pub persistence_prefix: Option<String>,
    /// `persistence.progress_storage`.
    pub progress_storage: Option<ProgressKind>,
    /// `persistence.diffbase_storage`.
    pub diffbase_storage: Option<DiffBaseKind>,
    /// The diff-base annotation's key.
    pub diffbase_key: Option<String>,
    /// The stanza under `status` of the status storages.
    pub status_field: Option<String>,
    /// `watching.inactivity_timeout`.
    pub watch_inactivity_timeout: Option<Duration>,
    /// `watching.server_timeout`, in whole seconds.
    pub watch_server_timeout: Option<Duration>,
    /// `queueing.worker_limit`.
    pub worker_limit: Option<u32>,
    /// `peering.name`.
    pub peering_name: Option<String>,
    /// `peering.priority`.
    pub peering_priority: Option<i64>,
    /// `peering.standalone` (only `true` is a value).
    pub peering_standalone: Option<bool>,
    /// `peering.mandatory` (only `true` is a value).
    pub peering_mandatory: Option<bool>,
    /// `peering.lifetime`.
    pub peering_lifetime: Option<Duration>,
    /// `networking.request_timeout`.
    pub api_timeout: Option<Duration>,
    /// `admission.managed`.
    pub webhook_managed: Option<String>,
}

/// One field of [`OperatorSettings`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Field {
    /// `persistence.finalizer`.
    Finalizer,
    /// The annotations' prefix.
    PersistencePrefix,
    /// `persistence.progress_storage`.
    ProgressStorage,
    /// `persistence.diffbase_storage`.
    DiffBaseStorage,
    /// The diff-base annotation's key.
    DiffBaseKey,
    /// The status storages' stanza.
    StatusField,
    /// `watching.inactivity_timeout`.
    WatchInactivityTimeout,
    /// `watching.server_timeout`.
    WatchServerTimeout,
    /// `queueing.worker_limit`.
    WorkerLimit,
    /// `peering.name`.
    PeeringName,
    /// `peering.priority`.
    PeeringPriority,
    /// `peering.standalone`.
    PeeringStandalone,
    /// `peering.mandatory`.
    PeeringMandatory,
    /// `peering.lifetime`.
    PeeringLifetime,
    /// `networking.request_timeout`.
    ApiTimeout,
    /// `admission.managed`.
    WebhookManaged,
}

impl Field {
    /// Every field.
    pub const ALL: [Self; 16] = [
        Self::Finalizer,
        Self::PersistencePrefix,
        Self::ProgressStorage,
        Self::DiffBaseStorage,
        Self::DiffBaseKey,
        Self::StatusField,
        Self::WatchInactivityTimeout,
        Self::WatchServerTimeout,
        Self::WorkerLimit,
        Self::PeeringName,
        Self::PeeringPriority,
        Self::PeeringStandalone,
        Self::PeeringMandatory,
        Self::PeeringLifetime,
        Self::ApiTimeout,
        Self::WebhookManaged,
    ];

    /// Whether the field is about peering (a change restarts the operator's peering).
    pub fn is_peering(self) -> bool {
        matches!(
            self,
            Self::PeeringName
                | Self::PeeringPriority
                | Self::PeeringStandalone
                | Self::PeeringMandatory
                | Self::PeeringLifetime
        )
    }

    /// Whether a change of the field restarts the engine (and, for peering's, the operator's
    /// peering first); the API client's timeout and the webhook configurations' name follow
    /// without a restart.
    pub fn restarts_engine(self) -> bool {
        !matches!(self, Self::ApiTimeout | Self::WebhookManaged)
    }

    /// The controller flag that does the same.
    pub fn flag(self) -> &'static str {
        match self {
            Self::Finalizer => "--finalizer",
            Self::PersistencePrefix => "--persistence-prefix",
            Self::ProgressStorage => "--progress-storage",
            Self::DiffBaseStorage => "--diffbase-storage",
            Self::DiffBaseKey => "--diffbase-key",
            Self::StatusField => "--status-field",
            Self::WatchInactivityTimeout => "--watch-inactivity-timeout",
            Self::WatchServerTimeout => "--watch-server-timeout",
            Self::WorkerLimit => "--worker-limit",
            Self::PeeringName => "--peering",
            Self::PeeringPriority => "--priority",
            Self::PeeringStandalone => "--standalone",
            Self::PeeringMandatory => "--peering/--priority/--dev",
            Self::PeeringLifetime => "--peering-lifetime",
            Self::ApiTimeout => "--api-timeout",
            Self::WebhookManaged => "--webhook-managed",
        }
    }

    /// The field's name on the wire (`ProcessSettings.operator.<name>`).
    pub fn name(self) -> &'static str {
        match self {
            Self::Finalizer => "finalizer",
            Self::PersistencePrefix => "persistence_prefix",
            Self::ProgressStorage => "progress_storage",
            Self::DiffBaseStorage => "diffbase_storage",
            Self::DiffBaseKey => "diffbase_key",
            Self::StatusField => "status_field",
            Self::WatchInactivityTimeout => "watch_inactivity_timeout",
            Self::WatchServerTimeout => "watch_server_timeout",
            Self::WorkerLimit => "worker_limit",
            Self::PeeringName => "peering_name",
            Self::PeeringPriority => "peering_priority",
            Self::PeeringStandalone => "peering_standalone",
            Self::PeeringMandatory => "peering_mandatory",
            Self::PeeringLifetime => "peering_lifetime",
            Self::ApiTimeout => "api_timeout",
            Self::WebhookManaged => "webhook_managed",
        }
    }
}

impl fmt::Display for Field {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl OperatorSettings {
    /// The value of `field` as the flag would take it, when set.
    pub fn value(&self, field: Field) -> Option<String> {
        let secs = |d: &Duration| format!("{}s", d.as_secs_f64());
        match field {
            Field::Finalizer => self.finalizer.clone(),
            Field::PersistencePrefix => self.persistence_prefix.clone(),
            Field::ProgressStorage => self.progress_storage.map(|k| {
                match k {
                    ProgressKind::Annotations => "annotations",
                    ProgressKind::Status => "status",
                    ProgressKind::Smart => "smart",
                }
                .to_owned()
            }),
            Field::DiffBaseStorage => self.diffbase_storage.map(|k| {
                match k {
                    DiffBaseKind::Annotations => "annotations",
                    DiffBaseKind::Status => "status",
                }
                .to_owned()
            }),
            Field::DiffBaseKey => self.diffbase_key.clone(),
            Field::StatusField => self.status_field.clone(),
            Field::WatchInactivityTimeout => self.watch_inactivity_timeout.as_ref().map(secs),
            Field::WatchServerTimeout => self.watch_server_timeout.as_ref().map(secs),
            Field::WorkerLimit => self.worker_limit.map(|n| n.to_string()),
            Field::PeeringName => self.peering_name.clone(),
            Field::PeeringPriority => self.peering_priority.map(|n| n.to_string()),
            Field::PeeringStandalone => self.peering_standalone.map(|b| b.to_string()),
            Field::PeeringMandatory => self.peering_mandatory.map(|b| b.to_string()),
            Field::PeeringLifetime => self.peering_lifetime.as_ref().map(secs),
            Field::ApiTimeout => self.api_timeout.as_ref().map(secs),
            Field::WebhookManaged => self.webhook_managed.clone(),
        }
    }

    /// Whether `field` is set.
    pub fn is_set(&self, field: Field) -> bool {
        match field {
            Field::Finalizer => self.finalizer.is_some(),
            Field::PersistencePrefix => self.persistence_prefix.is_some(),
            Field::ProgressStorage => self.progress_storage.is_some(),
            Field::DiffBaseStorage => self.diffbase_storage.is_some(),
            Field::DiffBaseKey => self.diffbase_key.is_some(),
            Field::StatusField => self.status_field.is_some(),
            Field::WatchInactivityTimeout => self.watch_inactivity_timeout.is_some(),
            Field::WatchServerTimeout => self.watch_server_timeout.is_some(),
            Field::WorkerLimit => self.worker_limit.is_some(),
            Field::PeeringName => self.peering_name.is_some(),
            Field::PeeringPriority => self.peering_priority.is_some(),
            Field::PeeringStandalone => self.peering_standalone.is_some(),
            Field::PeeringMandatory => self.peering_mandatory.is_some(),
            Field::PeeringLifetime => self.peering_lifetime.is_some(),
            Field::ApiTimeout => self.api_timeout.is_some(),
            Field::WebhookManaged => self.webhook_managed.is_some(),
        }
    }

    /// Takes `field` from `other` (set or not).
    pub fn take(&mut self, field: Field, other: &Self) {
        match field {
            Field::Finalizer => self.finalizer.clone_from(&other.finalizer),
            Field::PersistencePrefix => self.persistence_prefix.clone_from(&other.persistence_prefix),
            Field::ProgressStorage => self.progress_storage = other.progress_storage,
            Field::DiffBaseStorage => self.diffbase_storage = other.diffbase_storage,
            Field::DiffBaseKey => self.diffbase_key.clone_from(&other.diffbase_key),
            Field::StatusField => self.status_field.clone_from(&other.status_field),
            Field::WatchInactivityTimeout => self.watch_inactivity_timeout = other.watch_inactivity_timeout,
            Field::WatchServerTimeout => self.watch_server_timeout = other.watch_server_timeout,
            Field::WorkerLimit => self.worker_limit = other.worker_limit,
            Field::PeeringName => self.peering_name.clone_from(&other.peering_name),
            Field::PeeringPriority => self.peering_priority = other.peering_priority,
            Field::PeeringStandalone => self.peering_standalone = other.peering_standalone,
            Field::PeeringMandatory => self.peering_mandatory = other.peering_mandatory,
            Field::PeeringLifetime => self.peering_lifetime = other.peering_lifetime,
            Field::ApiTimeout => self.api_timeout = other.api_timeout,
            Field::WebhookManaged => self.webhook_managed.clone_from(&other.webhook_managed),
        }
    }

    /// The peering fields only (to tell whether the operator's peering must restart).
    pub fn peering(&self) -> Self {
        self.only(Field::is_peering)
    }

    /// The fields whose change restarts the engine only (to tell whether it must).
    pub fn restarting_engine(&self) -> Self {
        self.only(Field::restarts_engine)
    }

    fn only(&self, keep: impl Fn(Field) -> bool) -> Self {
        let mut out = Self::default();
        for field in Field::ALL.into_iter().filter(|f| keep(*f)) {
            out.take(field, self);
        }
        out
    }

    /// The fields that are set.
    pub fn set_fields(&self) -> impl Iterator<Item = Field> + '_ {
        Field::ALL.into_iter().filter(|f| self.is_set(*f))
    }

    /// Why a process's `wanted` settings are not all applied: the fields whose flags were
    /// given (`by_flags`, with the flags' values) with another value, and those an earlier
    /// process (`earlier`, oldest first) set to another value. Each as (field, why).
    pub fn overruled<'a>(
        wanted: &Self,
        by_flags: &Self,
        earlier: impl IntoIterator<Item = &'a Self> + Clone,
    ) -> Vec<(Field, String)> {
        let mut out = Vec::new();
        for field in wanted.set_fields() {
            let value = wanted.value(field).unwrap_or_default();
            if let Some(flag) = by_flags.value(field) {
                if flag != value {
                    let flag = if flag.is_empty() {
                        "\"\" (none)".to_owned()
                    } else {
                        flag
                    };
                    out.push((
                        field,
                        format!(
                            "{field} = {value:?} is not applied: the controller's {} {flag} wins (given, or fixed per node)",
                            field.flag()
                        ),
                    ));
                }
                continue;
            }
            let first = earlier.clone().into_iter().find_map(|p| p.value(field));
            if let Some(first) = first.filter(|first| *first != value) {
                out.push((
                    field,
                    format!(
                        "{field} = {value:?} is not applied: a handler process connected earlier set {first:?}, which wins"
                    ),
                ));
            }
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn finalizer(name: &str) -> OperatorSettings {
        OperatorSettings {
            finalizer: Some(name.into()),
            ..OperatorSettings::default()
        }
    }

    #[test]
    fn a_given_flag_or_an_earlier_process_overrules_a_value_and_says_so() {
        let earlier = finalizer("a.example/f");
        let wanted = OperatorSettings {
            worker_limit: Some(8),
            ..finalizer("b.example/f")
        };
        let flags = OperatorSettings {
            worker_limit: Some(16),
            ..OperatorSettings::default()
        };
        let why = OperatorSettings::overruled(&wanted, &flags, [&earlier]);
        assert_eq!(why.len(), 2, "{why:?}");
        assert_eq!(why[0].0, Field::Finalizer);
        assert!(
            why[0].1.contains("connected earlier set \"a.example/f\""),
            "{}",
            why[0].1
        );
        assert_eq!(why[1].0, Field::WorkerLimit);
        assert!(why[1].1.contains("--worker-limit 16"), "{}", why[1].1);
        // The same value as the earlier process's, or as the flag's, is no conflict.
        let same = OperatorSettings {
            worker_limit: Some(16),
            ..earlier.clone()
        };
        assert!(OperatorSettings::overruled(&same, &flags, [&earlier]).is_empty());
    }
}

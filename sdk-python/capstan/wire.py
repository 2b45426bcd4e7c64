"""Conversions between the SDK's values and `capstan.v1` messages: registrations for
`Hello`, invocations into `Call`s, and `Outcome`s into `InvocationResult`s."""

import base64
import binascii
import datetime
import json

from google.protobuf import duration_pb2, timestamp_pb2

from capstan.errors import ErrorsMode
from capstan.invoke import Call, Outcome, SubState
from capstan.registry import Handler, Resource
from capstan.structs import ABSENT, PRESENT, ConnectionInfo, Diff, DiffItem, DiffOperation, Reason
from capstan.v1 import common_pb2 as common
from capstan.v1 import invocation_pb2 as inv
from capstan.v1 import registration_pb2 as reg

_KINDS = {
    "create": reg.HANDLER_KIND_CREATE, "update": reg.HANDLER_KIND_UPDATE,
    "delete": reg.HANDLER_KIND_DELETE, "resume": reg.HANDLER_KIND_RESUME,
    "field": reg.HANDLER_KIND_FIELD, "event": reg.HANDLER_KIND_EVENT,
    "daemon": reg.HANDLER_KIND_DAEMON, "timer": reg.HANDLER_KIND_TIMER,
    "startup": reg.HANDLER_KIND_STARTUP, "cleanup": reg.HANDLER_KIND_CLEANUP,
    "login": reg.HANDLER_KIND_LOGIN, "probe": reg.HANDLER_KIND_PROBE,
    "index": reg.HANDLER_KIND_INDEX,
    "validate": reg.HANDLER_KIND_VALIDATE, "mutate": reg.HANDLER_KIND_MUTATE,
}
_ERRORS = {
    ErrorsMode.TEMPORARY: reg.ERRORS_MODE_TEMPORARY,
    ErrorsMode.PERMANENT: reg.ERRORS_MODE_PERMANENT,
    ErrorsMode.IGNORED: reg.ERRORS_MODE_IGNORED,
}
_REASONS = {
    inv.CHANGE_REASON_CREATE: Reason.CREATE, inv.CHANGE_REASON_UPDATE: Reason.UPDATE,
    inv.CHANGE_REASON_DELETE: Reason.DELETE, inv.CHANGE_REASON_RESUME: Reason.RESUME,
}
_OPS = {
    inv.DIFF_OPERATION_ADD: DiffOperation.ADD, inv.DIFF_OPERATION_CHANGE: DiffOperation.CHANGE,
    inv.DIFF_OPERATION_REMOVE: DiffOperation.REMOVE,
}
_EVENTS = {
    inv.EVENT_TYPE_ADDED: "ADDED", inv.EVENT_TYPE_MODIFIED: "MODIFIED",
    inv.EVENT_TYPE_DELETED: "DELETED",
}


def json_msg(value):
    return common.Json(json=json.dumps(value, separators=(",", ":")).encode())


def _opt_json(parent, name):
    return json.loads(getattr(parent, name).json) if parent.HasField(name) and getattr(parent, name).json else None


def duration(seconds):
    d = duration_pb2.Duration()
    d.FromTimedelta(datetime.timedelta(seconds=seconds))
    return d


def _meta(conditions):
    out = {}
    for key, cond in (conditions or {}).items():
        if cond is PRESENT:
            out[key] = reg.MetaMatch(presence=reg.PRESENCE_PRESENT)
        elif cond is ABSENT:
            out[key] = reg.MetaMatch(presence=reg.PRESENCE_ABSENT)
        elif isinstance(cond, str):
            out[key] = reg.MetaMatch(equals=cond)
        # callables are evaluated by the SDK (sdk_when)
    return out


def _value(cond):
    if cond is None or callable(cond):
        return None
    if cond is PRESENT:
        return reg.ValueMatch(presence=reg.PRESENCE_PRESENT)
    if cond is ABSENT:
        return reg.ValueMatch(presence=reg.PRESENCE_ABSENT)
    return reg.ValueMatch(equals=json_msg(cond))


def registration(handler: Handler) -> reg.HandlerRegistration:
    """The `HandlerRegistration` of one handler."""
    msg = reg.HandlerRegistration(handler_id=handler.id, kind=_KINDS[handler.kind])
    if handler.resource is not None:
        msg.resource.CopyFrom(reg.ResourceSelector(
            group=handler.resource.group, version=handler.resource.version, name=handler.resource.name))
    filters = reg.Filters(labels=_meta(handler.labels), annotations=_meta(handler.annotations),
                          field=handler.field or "", sdk_when=bool(handler.sdk_filters))
    for name in ("value", "old", "new"):
        match = _value(getattr(handler, name))
        if match is not None:
            getattr(filters, name).CopyFrom(match)
    if filters.ByteSize():
        msg.filters.CopyFrom(filters)
    if handler.errors is not None:
        msg.errors_mode = _ERRORS[handler.errors]
    if handler.retries is not None:
        msg.retries = handler.retries
    if handler.backoff is not None:
        msg.backoff.CopyFrom(duration(handler.backoff))
    if handler.timeout is not None:
        msg.timeout.CopyFrom(duration(handler.timeout))
    if handler.param is not None:
        msg.param.CopyFrom(json_msg(handler.param))
    if handler.max_in_flight is not None:
        msg.max_in_flight = handler.max_in_flight
    o = handler.options
    if handler.kind == "daemon":
        d = reg.DaemonOptions()
        for key in ("initial_delay", "cancellation_backoff", "cancellation_timeout"):
            if o.get(key) is not None:
                getattr(d, key).CopyFrom(duration(_secs(o[key])))
        msg.daemon.CopyFrom(d)
    elif handler.kind == "timer":
        t = reg.TimerOptions(sharp=bool(o.get("sharp")))
        t.interval.CopyFrom(duration(_secs(o["interval"])))
        for key in ("initial_delay", "idle"):
            if o.get(key) is not None:
                getattr(t, key).CopyFrom(duration(_secs(o[key])))
        msg.timer.CopyFrom(t)
    elif handler.kind == "delete" and handler.optional:
        msg.delete.CopyFrom(reg.DeleteOptions(optional=True))
    elif handler.kind == "resume" and handler.deleted:
        msg.resume.CopyFrom(reg.ResumeOptions(deleted=True))
    elif handler.kind in ("validate", "mutate"):
        a = reg.AdmissionOptions(subresource=o.get("subresource") or "", side_effects=bool(o.get("side_effects")),
                                 ignore_failures=bool(o.get("ignore_failures")))
        a.operations.extend(getattr(reg, f"OPERATION_{op}") for op in o.get("operations") or ())
        msg.admission.CopyFrom(a)
    return msg


def _secs(value):
    return value.total_seconds() if isinstance(value, datetime.timedelta) else float(value)


def _time(ts):
    return ts.ToDatetime(tzinfo=datetime.timezone.utc)


def call_of(msg: inv.Invocation, handler: Handler) -> Call:
    """The `Call` of one invocation."""
    call = Call(handler=handler, invocation_id=msg.invocation_id, attempt=msg.attempt or 1)
    if msg.HasField("body"):
        call.body = json.loads(msg.body.json) if msg.body.json else {}
    if msg.HasField("resource"):
        r = msg.resource
        call.resource = Resource(group=r.group, version=r.version, name=r.plural)
    if msg.HasField("started_time"):
        call.started = _time(msg.started_time)
    if msg.HasField("param"):
        call.param = _opt_json(msg, "param")
    payload = msg.WhichOneof("payload")
    if payload == "change":
        c = msg.change
        call.reason = _REASONS.get(c.reason)
        call.old = _opt_json(c, "old")
        call.new = _opt_json(c, "new")
        call.diff = Diff(
            DiffItem(_OPS.get(d.operation, DiffOperation.CHANGE), tuple(d.path), _opt_json(d, "old"), _opt_json(d, "new"))
            for d in c.diff
        )
    elif payload == "event":
        call.event_type = _EVENTS.get(msg.event.type)
    elif payload == "index":
        call.index_deleted = msg.index.deleted
    elif payload == "admission":
        a = msg.admission
        call.admission = {
            "operation": a.operation, "subresource": a.subresource or None, "dryrun": a.dry_run,
            "old": _opt_json(a, "old_object"), "userinfo": _opt_json(a, "user_info") or {},
            "headers": dict(a.headers),
        }
    for st in msg.subhandlers:
        call.subhandlers[st.subhandler_id] = SubState(
            retries=st.retries, success=st.success, failure=st.failure,
            delayed_until=_time(st.delayed_until) if st.HasField("delayed_until") else None,
            message=st.message, started=_time(st.started_time) if st.HasField("started_time") else None,
        )
    return call


def _diagnostics(outcome: Outcome, handler_id):
    return [common.Diagnostic(
        severity=common.SEVERITY_ERROR, summary=outcome.message.splitlines()[0] if outcome.message else outcome.status,
        detail=outcome.message, error_type=outcome.error_type, stack_trace=outcome.stack,
        metadata={"handler": handler_id},
    )]


def _success(outcome: Outcome):
    s = inv.Success()
    if outcome.verdict is not None:
        v = outcome.verdict
        s.admission.CopyFrom(inv.AdmissionVerdict(allowed=v["allowed"], message=v.get("message") or "",
                                                  code=int(v.get("code") or 0), warnings=list(v.get("warnings") or ())))
    elif isinstance(outcome.result, ConnectionInfo):
        s.credentials.CopyFrom(credentials(outcome.result))
    elif outcome.result is not None:
        s.result.CopyFrom(json_msg(outcome.result))
    return s


def credentials(info: ConnectionInfo) -> inv.Credentials:
    c = inv.Credentials(server=info.server, insecure=bool(info.insecure), username=info.username or "",
                        password=info.password or "", token=info.token or "",
                        default_namespace=info.default_namespace or "", priority=info.priority or 0)
    for field, data, path in (("certificate_authority", info.ca_data, info.ca_path),
                              ("client_certificate", info.certificate_data, info.certificate_path),
                              ("client_key", info.private_key_data, info.private_key_path)):
        if data is None and path:
            with open(path, "rb") as f:
                data = f.read()
        if data is not None:
            setattr(c, field, _pem(data))
    if isinstance(info.expiration, datetime.datetime):
        c.expiration_time.FromDatetime(info.expiration)
    return c


def _pem(data):
    """PEM bytes from kopf's `*_data`: PEM, or PEM encoded in base64 (as kubeconfigs hold it)."""
    raw = data.encode() if isinstance(data, str) else bytes(data)
    if raw.lstrip().startswith(b"-----BEGIN "):
        return raw
    try:
        return base64.b64decode(raw, validate=True)
    except (binascii.Error, ValueError):
        return raw


def _fill(target, outcome: Outcome, handler_id):
    """Sets the oneof `outcome` of an InvocationResult or SubhandlerOutcome."""
    if outcome.status == "success":
        target.success.CopyFrom(_success(outcome))
    elif outcome.status == "temporary":
        t = inv.TemporaryError(diagnostics=_diagnostics(outcome, handler_id))
        if outcome.delay is not None:
            t.retry_after.CopyFrom(duration(max(outcome.delay, 0.0)))
        target.temporary_error.CopyFrom(t)
    elif outcome.status == "permanent":
        target.permanent_error.CopyFrom(inv.PermanentError(diagnostics=_diagnostics(outcome, handler_id)))
    elif outcome.status == "unclassified":
        target.unclassified_error.CopyFrom(inv.UnclassifiedError(diagnostics=_diagnostics(outcome, handler_id)))
    elif outcome.status == "cancelled":
        target.cancelled.CopyFrom(inv.Cancelled())
    elif outcome.status == "skipped":
        target.skipped.CopyFrom(inv.Skipped())
    elif outcome.status == "deferred":
        target.deferred.CopyFrom(inv.Deferred())


def result(invocation_id, handler_id, outcome: Outcome, seconds) -> inv.InvocationResult:
    """The `InvocationResult` of one outcome (patches only with a success)."""
    msg = inv.InvocationResult(invocation_id=invocation_id)
    _fill(msg, outcome, handler_id)
    msg.duration.CopyFrom(duration(max(seconds, 0.0)))
    if outcome.status == "success":
        msg.patches.extend(patches(outcome))
    for sub in outcome.subhandlers:
        so = inv.SubhandlerOutcome(subhandler_id=sub.id)
        _fill(so, sub.outcome, f"{handler_id}/{sub.id}")
        msg.subhandlers.append(so)
    return msg


def patches(outcome: Outcome):
    out = []
    if outcome.object_patch:
        out.append(common.Patch(type=common.PATCH_TYPE_MERGE, target=common.PATCH_TARGET_OBJECT,
                                body=json_msg(outcome.object_patch)))
    if outcome.status_patch:
        out.append(common.Patch(type=common.PATCH_TYPE_MERGE, target=common.PATCH_TARGET_STATUS,
                                body=json_msg(outcome.status_patch)))
    return out

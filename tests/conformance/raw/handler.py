"""The raw conformance handler: the conformance kit's fixed handlers (tests/conformance/README.md,
"The conformance handler") written with stock `grpcio` and stubs generated from proto/ at start,
without any Capstan SDK, to show that the `capstan.v1` protocol is usable from proto/ alone.

Environment:
  CAPSTAN_ENDPOINT               `unix:///path` or `host:port` (default unix:///run/capstan/capstan.sock)
  CAPSTAN_CONFORMANCE_FEATURES   comma-separated features whose handlers are registered (unset: all)

Logs go to standard error only. SIGTERM (or SIGINT) stops it: goodbye, results of what runs,
its side of the stream closed, exit 0. A FAILED_PRECONDITION rejection exits 1.
"""

import importlib.resources
import json
import logging
import os
import queue
import random
import re
import shutil
import signal
import sys
import tempfile
import threading
import time
import uuid

log = logging.getLogger("raw-grpcio")

SIXTEEN_MIB = 16 * 1024 * 1024
GROUP, VERSION, PLURAL = "conformance.capstan.dev", "v1", "widgets"
BACKOFF_MIN, BACKOFF_MAX = 0.25, 5.0
FAREWELL_WAIT, FINISH_WAIT, CANCEL_WAIT, CLOSE_WAIT = 10.0, 5.0, 1.0, 5.0
SDK_VERSION = "0.1.0"


# ----------------------------------------------------------------------------------------------
# Stubs, generated from proto/ at start.

def generate_stubs():
    """Generates the Python stubs of proto/capstan/v1 into a temporary directory, imports them
    and removes the directory (the modules stay loaded)."""
    from grpc_tools import protoc

    here = os.path.dirname(os.path.abspath(__file__))
    proto_dir = os.path.normpath(os.path.join(here, "..", "..", "..", "proto"))
    well_known = str(importlib.resources.files("grpc_tools") / "_proto")
    out_dir = tempfile.mkdtemp(prefix="capstan-raw-stubs-")
    try:
        files = sorted(
            "capstan/v1/" + name
            for name in os.listdir(os.path.join(proto_dir, "capstan", "v1"))
            if name.endswith(".proto")
        )
        code = protoc.main(["protoc", f"-I{proto_dir}", f"-I{well_known}",
                            f"--python_out={out_dir}", f"--grpc_python_out={out_dir}"] + files)
        if code != 0:
            raise SystemExit(f"protoc failed with exit code {code}")
        # Regular packages, so that no other `capstan` package on the path can shadow them.
        for package in ("capstan", os.path.join("capstan", "v1")):
            open(os.path.join(out_dir, package, "__init__.py"), "a").close()
        sys.path.insert(0, out_dir)
        from capstan.v1 import common_pb2, invocation_pb2, registration_pb2
        from capstan.v1 import runtime_service_pb2, runtime_service_pb2_grpc
        sys.path.remove(out_dir)
    finally:
        shutil.rmtree(out_dir, ignore_errors=True)
    return common_pb2, invocation_pb2, registration_pb2, runtime_service_pb2, runtime_service_pb2_grpc


# Filled in by main() once the stubs exist.
grpc = cm = iv = rg = rs = rs_grpc = None


# ----------------------------------------------------------------------------------------------
# The fixed handlers and the features that register them.

FEATURES = {
    "change": ["create", "update", "delete", "resume"],
    "field": ["field/spec.watched"],
    "event": ["event"],
    "daemon": ["daemon"],
    "timer": ["timer"],
    "index": ["index"],
    "admission": ["validate", "mutate"],
    "sdk_filters": ["when"],
    "activities": ["startup", "cleanup", "login"],
    "probe": ["probe"],
    "subhandlers": [], "object_updates": [], "result_ack": [], "cleanup_on_goodbye": [], "tcp": [],
    "flow_control": [], "message_limit": [],
}
# The handlers in the order of the README's table.
ORDER = ["create", "update", "delete", "resume", "field/spec.watched", "event", "daemon", "timer", "index",
         "validate", "mutate", "when", "startup", "cleanup", "login", "probe"]
ACTIVITIES = {"startup", "cleanup", "login", "probe"}


def claimed_features():
    raw = os.environ.get("CAPSTAN_CONFORMANCE_FEATURES")
    if raw is None or not raw.strip():
        return set(FEATURES)
    features = {f.strip() for f in raw.split(",") if f.strip()}
    for unknown in sorted(features - set(FEATURES)):
        log.warning("unknown feature %r in CAPSTAN_CONFORMANCE_FEATURES: ignored", unknown)
    return features & set(FEATURES)


def capabilities(features):
    caps = []
    for feature, cap in (("result_ack", rs.CAPABILITY_RESULT_ACK), ("sdk_filters", rs.CAPABILITY_SDK_FILTERS),
                         ("subhandlers", rs.CAPABILITY_SUBHANDLERS), ("object_updates", rs.CAPABILITY_OBJECT_UPDATES),
                         ("cleanup_on_goodbye", rs.CAPABILITY_CLEANUP_ON_GOODBYE)):
        if feature in features:
            caps.append(cap)
    return caps


def seconds(value):
    from google.protobuf import duration_pb2

    d = duration_pb2.Duration()
    d.FromNanoseconds(max(0, int(round(float(value) * 1e9))))
    return d


def registration(handler_id):
    kinds = {
        "create": rg.HANDLER_KIND_CREATE, "update": rg.HANDLER_KIND_UPDATE, "delete": rg.HANDLER_KIND_DELETE,
        "resume": rg.HANDLER_KIND_RESUME, "field/spec.watched": rg.HANDLER_KIND_FIELD, "event": rg.HANDLER_KIND_EVENT,
        "daemon": rg.HANDLER_KIND_DAEMON, "timer": rg.HANDLER_KIND_TIMER, "index": rg.HANDLER_KIND_INDEX,
        "validate": rg.HANDLER_KIND_VALIDATE, "mutate": rg.HANDLER_KIND_MUTATE, "when": rg.HANDLER_KIND_CREATE,
        "startup": rg.HANDLER_KIND_STARTUP, "cleanup": rg.HANDLER_KIND_CLEANUP, "login": rg.HANDLER_KIND_LOGIN,
        "probe": rg.HANDLER_KIND_PROBE,
    }
    reg = rg.HandlerRegistration(handler_id=handler_id, kind=kinds[handler_id])
    if handler_id not in ACTIVITIES:
        reg.resource.CopyFrom(rg.ResourceSelector(group=GROUP, version=VERSION, name=PLURAL))
    if handler_id == "create":
        reg.param.CopyFrom(to_json({"p": 1}))
    elif handler_id == "update":
        reg.retries = 3
        reg.backoff.CopyFrom(seconds(2))
        reg.timeout.CopyFrom(seconds(30))
    elif handler_id == "field/spec.watched":  # kopf's id of `field` on spec.watched
        reg.filters.field = "spec.watched"
    elif handler_id == "timer":
        reg.timer.interval.CopyFrom(seconds(3600))
    elif handler_id == "when":
        reg.filters.sdk_when = True
    return reg


# ----------------------------------------------------------------------------------------------
# JSON helpers.

def to_json(value):
    return cm.Json(json=json.dumps(value, separators=(",", ":"), ensure_ascii=False).encode("utf-8"))


def from_json(message, field):
    """The JSON value of an optional `Json` field, None when unset."""
    if not message.HasField(field):
        return None
    text = getattr(message, field).json
    return json.loads(text.decode("utf-8")) if text else None


def deep_merge(base, patch):
    """kopf's `patch.update(V)`, deep for nested objects."""
    out = dict(base)
    for key, value in patch.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = deep_merge(out[key], value)
        elif isinstance(value, dict):
            out[key] = deep_merge({}, value)
        else:
            out[key] = value
    return out


def to_patches(document):
    """A handler's merge patch as wire patches: the object (all but `status`), then `status`
    for the status subresource (as the SDKs do)."""
    patches = []
    if not document:
        return patches
    obj = {k: v for k, v in document.items() if k != "status"}
    if obj:
        patches.append(cm.Patch(type=cm.PATCH_TYPE_MERGE, target=cm.PATCH_TARGET_OBJECT, body=to_json(obj)))
    if "status" in document:
        patches.append(cm.Patch(type=cm.PATCH_TYPE_MERGE, target=cm.PATCH_TARGET_STATUS,
                                body=to_json({"status": document["status"]})))
    return patches


def now_ts(ts):
    """Seconds from now until a Timestamp (negative when past)."""
    return ts.seconds + ts.nanos / 1e9 - time.time()


# ----------------------------------------------------------------------------------------------
# How a script ends.

class HandlerCancelled(BaseException):
    """A wait ended because the invocation was cancelled."""


class TemporaryError(Exception):
    def __init__(self, message, delay=None):
        super().__init__(message)
        self.message, self.delay = message, delay


class PermanentError(Exception):
    def __init__(self, message):
        super().__init__(message)
        self.message = message


class AdmissionError(PermanentError):
    """kopf's AdmissionError, a PermanentError: a denial in an admission handler."""

    def __init__(self, message, code):
        super().__init__(message)
        self.code = code


class ScriptCrash(RuntimeError):
    """An error of no kopf class."""


def diagnostics(error, handler_id):
    message = str(getattr(error, "message", None) or error)
    return [cm.Diagnostic(severity=cm.SEVERITY_ERROR, summary=(message.splitlines() or [type(error).__name__])[0],
                          detail=message, error_type=type(error).__name__, metadata={"handler": handler_id})]


def fill_error(target, error, handler_id):
    """Sets the error outcome of an InvocationResult or SubhandlerOutcome."""
    if isinstance(error, TemporaryError):
        t = iv.TemporaryError(diagnostics=diagnostics(error, handler_id))
        if error.delay is not None:
            t.retry_after.CopyFrom(seconds(error.delay))
        target.temporary_error.CopyFrom(t)
    elif isinstance(error, PermanentError):
        target.permanent_error.CopyFrom(iv.PermanentError(diagnostics=diagnostics(error, handler_id)))
    else:
        target.unclassified_error.CopyFrom(iv.UnclassifiedError(diagnostics=diagnostics(error, handler_id)))


# ----------------------------------------------------------------------------------------------
# One running invocation and its script.

REASONS = {1: "create", 2: "update", 3: "delete", 4: "resume"}
OPERATIONS = {1: "add", 2: "change", 3: "remove"}
EVENT_TYPES = {1: "ADDED", 2: "MODIFIED", 3: "DELETED"}
LEVELS = {"debug": 1, "info": 2, "warning": 3, "error": 4}
CHANGE_HANDLERS = {"create", "update", "delete", "resume", "field/spec.watched", "when"}
MAX_SUBHANDLER_DEPTH = 8


class Frame:
    """What one (sub-)handler call accumulates: its patch, its warnings, its declared
    sub-handlers, and the retry count it sees."""

    def __init__(self, retry):
        self.retry = retry
        self.patch = {}
        self.warnings = []
        self.subhandlers = []


class Run:
    def __init__(self, session, invocation):
        self.session = session
        self.inv = invocation
        self.id = invocation.invocation_id
        self.handler_id = invocation.handler_id
        self.cancelled = threading.Event()
        self.lock = threading.Lock()
        self.finished = False
        self.started = time.monotonic()
        self.body_error = None
        try:
            self.body = from_json(invocation, "body")
        except ValueError as error:  # reported as the invocation's (unclassified) failure
            self.body, self.body_error = None, error
        self.timer = None

    # -- the stream side

    def cancel(self, why):
        if not self.cancelled.is_set():
            log.info("invocation %s (%s): cancelled (%s)", self.id, self.handler_id, why)
        self.cancelled.set()

    def set_body(self, body):
        with self.lock:
            self.body = body

    def current_body(self):
        with self.lock:
            return self.body

    def send_log(self, level, message, **extra):
        log.log({1: logging.DEBUG, 2: logging.INFO, 3: logging.WARNING, 4: logging.ERROR}.get(level, logging.INFO),
                "[%s %s] %s", self.handler_id, self.id, message)
        record = rs.LogRecord(invocation_id=self.id, level=level, message=message, **extra)
        record.time.GetCurrentTime()
        self.session.send(rs.ConnectRequest(log=record))

    def finish(self, result):
        """Sends the one result of this invocation (later calls do nothing)."""
        with self.lock:
            if self.finished:
                return False
            self.finished = True
        if self.timer is not None:
            self.timer.cancel()
        result.invocation_id = self.id
        result.duration.CopyFrom(seconds(time.monotonic() - self.started))
        self.session.finished(self, result)
        return True

    # -- the handler side

    def start(self):
        if self.inv.HasField("deadline"):
            remaining = max(0.0, now_ts(self.inv.deadline))
            self.timer = threading.Timer(remaining, self.cancel, args=("deadline passed",))
            self.timer.daemon = True
            self.timer.start()
        threading.Thread(target=self.main, name=f"inv-{self.id}", daemon=True).start()

    def main(self):
        try:
            result = self.execute()
        except HandlerCancelled:
            result = iv.InvocationResult(cancelled=iv.Cancelled())
        except BaseException as error:  # noqa: BLE001 - every failure becomes the one result
            if self.cancelled.is_set():
                result = iv.InvocationResult(cancelled=iv.Cancelled())
                self.finish(result)
                return
            log.info("invocation %s (%s) failed: %s: %s", self.id, self.handler_id, type(error).__name__, error)
            result = iv.InvocationResult()
            fill_error(result, error, self.handler_id)
        self.finish(result)

    def wait(self, secs):
        if self.cancelled.wait(max(0.0, secs)):
            raise HandlerCancelled()

    def execute(self):
        hid = self.handler_id
        if self.body_error is not None:
            raise ScriptCrash(f"the body is not JSON: {self.body_error}")
        if hid not in self.session.process.handler_ids:
            log.warning("invocation %s: unknown handler id %r", self.id, hid)
            return iv.InvocationResult(permanent_error=iv.PermanentError(diagnostics=[cm.Diagnostic(
                severity=cm.SEVERITY_ERROR, summary=f"no handler {hid!r} is registered in this process",
                reason="UNKNOWN_HANDLER", error_type="UnknownHandler")]))
        if hid == "startup":
            if self.inv.attempt <= 1:
                raise TemporaryError("not yet", delay=0.25)
            self.send_log(rs.LOG_LEVEL_INFO, "startup")
            return iv.InvocationResult(success=iv.Success())
        if hid == "cleanup":
            self.send_log(rs.LOG_LEVEL_INFO, "cleanup")
            return iv.InvocationResult(success=iv.Success())
        if hid == "login":
            return iv.InvocationResult(success=iv.Success(credentials=iv.Credentials(
                server="https://conformance.invalid:6443", token="conformance-token", default_namespace="conformance")))
        if hid == "probe":
            return iv.InvocationResult(success=iv.Success(result=to_json({"probe": "ok"})))
        if hid == "index":
            return self.execute_index()
        if hid == "when":
            spec = (self.current_body() or {}).get("spec") if isinstance(self.current_body(), dict) else None
            if not (isinstance(spec, dict) and spec.get("allowed") is True):
                return iv.InvocationResult(skipped=iv.Skipped())
        if hid in ("validate", "mutate"):
            return self.execute_admission()

        frame = Frame(retry=max(0, self.inv.attempt - 1))
        value = self.script(frame)
        result = iv.InvocationResult(success=iv.Success())
        if value is not None:
            result.success.result.CopyFrom(to_json(value))
        patch = frame.patch
        if frame.subhandlers:
            if hid not in CHANGE_HANDLERS:
                log.warning("invocation %s: sub-handlers declared by a %s handler are ignored", self.id, hid)
            elif rs.CAPABILITY_SUBHANDLERS not in self.session.capabilities:
                log.warning("invocation %s: sub-handlers declared without CAPABILITY_SUBHANDLERS are ignored", self.id)
            else:
                outcomes, patch, _ = self.run_subhandlers(frame.subhandlers, "", patch, 1)
                result.subhandlers.extend(outcomes)
        result.patches.extend(to_patches(patch))
        return result

    def execute_admission(self):
        frame = Frame(retry=max(0, self.inv.attempt - 1))
        try:
            value = self.script(frame)
        except AdmissionError as denial:
            if self.cancelled.is_set():
                raise HandlerCancelled()
            return iv.InvocationResult(success=iv.Success(admission=iv.AdmissionVerdict(
                allowed=False, message=denial.message, code=int(denial.code or 0), warnings=frame.warnings)))
        # The answer is the verdict: a returned value (an echo too) is not sent.
        del value
        result = iv.InvocationResult(success=iv.Success(admission=iv.AdmissionVerdict(
            allowed=True, warnings=frame.warnings)))
        result.patches.extend(to_patches(frame.patch))
        return result

    def execute_index(self):
        ref = self.inv.resource
        indexes = self.session.indexes
        if self.inv.index.deleted:
            indexes.remove(ref.uid)
            return iv.InvocationResult(success=iv.Success())
        frame = Frame(retry=max(0, self.inv.attempt - 1))
        try:
            value = self.script(frame)
        except HandlerCancelled:
            raise
        except (TemporaryError, PermanentError):
            indexes.remove(ref.uid)
            raise
        # An unclassified error (errors mode IGNORED, the index default) keeps the object's values.
        indexes.fold(ref, value)
        result = iv.InvocationResult(success=iv.Success())
        if value is not None:
            result.success.result.CopyFrom(to_json(value))
        return result

    def run_subhandlers(self, declared, prefix, patch, depth):
        """Runs the declared sub-handlers that are neither finished nor waiting, in order.
        Returns their outcomes, the patch with the succeeded ones' patches merged in, and
        whether any is unfinished (None, or the earliest delay in seconds, 0 when unknown)."""
        states = {s.subhandler_id: s for s in self.inv.subhandlers}
        outcomes, delays = [], []

        def wait_for(delay):
            delays.append(None if delay is None else max(0.0, delay))

        for sub in declared:
            if self.cancelled.is_set():
                raise HandlerCancelled()
            sid = prefix + str(sub.get("id"))
            state = states.get(sid)
            if state is not None and (state.success or state.failure):
                continue
            if state is not None and state.HasField("delayed_until") and now_ts(state.delayed_until) > 0:
                wait_for(now_ts(state.delayed_until))
                continue
            outcome = iv.SubhandlerOutcome(subhandler_id=sid)
            frame = Frame(retry=state.retries if state is not None else 0)
            try:
                script = sub.get("script")
                value = self.script(frame, script if isinstance(script, list) else [])
                sub_patch = frame.patch
                nested_unfinished = None
                if frame.subhandlers and depth < MAX_SUBHANDLER_DEPTH:
                    nested, sub_patch, nested_unfinished = self.run_subhandlers(
                        frame.subhandlers, sid + "/", sub_patch, depth + 1)
                    outcomes.extend(nested)
                if nested_unfinished is None:
                    outcome.success.CopyFrom(iv.Success())
                    if value is not None:
                        outcome.success.result.CopyFrom(to_json(value))
                    patch = deep_merge(patch, sub_patch)
                else:
                    raise TemporaryError("sub-handlers are not finished yet", delay=nested_unfinished or None)
            except HandlerCancelled:
                raise
            except Exception as error:  # noqa: BLE001 - a sub-handler's failure is its own outcome
                if self.cancelled.is_set():
                    raise HandlerCancelled()
                log.info("invocation %s: sub-handler %r failed: %s", self.id, sid, error)
                fill_error(outcome, error, f"{self.handler_id}/{sid}")
                if isinstance(error, TemporaryError):
                    wait_for(error.delay)
                elif not isinstance(error, PermanentError):
                    wait_for(None)
            outcomes.append(outcome)
        known = [d for d in delays if d is not None]
        unfinished = None if not delays else (min(known) if known else 0.0)
        return outcomes, patch, unfinished

    # -- the script

    def script(self, frame, script=None):
        """Runs a script (the body's spec.script unless given); returns the result value."""
        if script is None:
            body = self.current_body()
            spec = body.get("spec") if isinstance(body, dict) else None
            script = spec.get("script") if isinstance(spec, dict) else None
            if not isinstance(script, list):
                return None
        for action in script:
            if not isinstance(action, dict) or len(action) != 1:
                raise ScriptCrash(f"malformed action: {json.dumps(action)}")
            (name, arg), = action.items()
            if name == "log":
                level = LEVELS.get(str(arg.get("level", "info")).lower(), rs.LOG_LEVEL_INFO)
                self.send_log(level, str(arg.get("message", "")))
            elif name == "event":
                self.post_event(str(arg.get("type", "Normal")), str(arg.get("reason", "")), str(arg.get("message", "")))
            elif name == "patch":
                if not isinstance(arg, dict):
                    raise ScriptCrash("a patch action needs an object")
                frame.patch = deep_merge(frame.patch, arg)
            elif name == "return":
                return arg
            elif name == "echo":
                return self.echo(frame)
            elif name == "temporary":
                delay = arg.get("delay")
                raise TemporaryError(str(arg.get("message", "")), delay=float(delay) if delay is not None else None)
            elif name == "permanent":
                raise PermanentError(str(arg.get("message", "")))
            elif name == "crash":
                raise ScriptCrash(str(arg.get("message", "")))
            elif name == "sleep":
                self.wait(float(arg))
            elif name == "hang":
                while True:
                    self.wait(3600)
            elif name == "hang_ignoring_cancel":
                time.sleep(max(0.0, float(arg)))
                return {"ignored_cancel": True}
            elif name == "subhandlers":
                frame.subhandlers = [s for s in arg if isinstance(s, dict)]
            elif name == "deny":
                raise AdmissionError(str(arg.get("message", "")), arg.get("code") or 0)
            elif name == "warn":
                frame.warnings.append(str(arg))
            elif name == "flow":
                handler_id, limit = str(arg.get("handler") or ""), int(arg.get("max_in_flight", 0))
                self.session.process.flow[handler_id] = limit
                self.session.send(rs.ConnectRequest(flow_control=rs.FlowControl(handler_id=handler_id, max_in_flight=limit)))
            else:
                raise ScriptCrash(f"unknown action {name!r}")
        return None

    def post_event(self, type_, reason, message):
        ref = self.inv.resource
        body = self.current_body() if isinstance(self.current_body(), dict) else {}
        meta = body.get("metadata") or {}
        api_version = body.get("apiVersion") or ""
        group, _, version = api_version.rpartition("/")
        obj = cm.ResourceRef(group=ref.group or group, version=ref.version or version, kind=ref.kind or body.get("kind", ""),
                             namespace=ref.namespace or meta.get("namespace", "") or "",
                             name=ref.name or meta.get("name", "") or "", uid=ref.uid or meta.get("uid", "") or "")
        level = rs.LOG_LEVEL_WARNING if type_ == "Warning" else rs.LOG_LEVEL_ERROR if type_ == "Error" else rs.LOG_LEVEL_INFO
        self.send_log(level, message, posting=rs.EVENT_POSTING_ALWAYS, reason=reason, object=obj, event_type=type_)

    def echo(self, frame):
        inv = self.inv
        body = self.current_body()
        body = body if isinstance(body, dict) else {}
        meta = body.get("metadata") if isinstance(body.get("metadata"), dict) else {}
        ref = inv.resource
        payload = inv.WhichOneof("payload")
        out = {
            "name": meta.get("name") or ref.name or None,
            "namespace": meta.get("namespace") or ref.namespace or None,
            "uid": meta.get("uid") or ref.uid or None,
            "spec": body.get("spec"),
            "labels": meta.get("labels") or {},
            "retry": frame.retry,
            "param": from_json(inv, "param"),
            "reason": None, "old": None, "new": None, "diff": None,
            "event_type": None,
        }
        if payload == "change":
            c = inv.change
            out["reason"] = REASONS.get(c.reason)
            out["old"] = from_json(c, "old")
            out["new"] = from_json(c, "new")
            out["diff"] = [[OPERATIONS.get(d.operation, "change"), list(d.path), from_json(d, "old"), from_json(d, "new")]
                           for d in c.diff]
        elif payload == "event":
            out["event_type"] = EVENT_TYPES.get(inv.event.type)
        return out


# ----------------------------------------------------------------------------------------------
# The in-process index (kopf's rules), emptied on every new stream.

class Index:
    def __init__(self):
        self.lock = threading.Lock()
        self.by_object = {}  # uid -> (namespace, name, uid), {key: value}
        self.stores = {}     # key -> {(namespace, name, uid): value}

    def remove(self, uid):
        with self.lock:
            entry = self.by_object.pop(uid, None)
            if entry is None:
                return
            obj, values = entry
            for key in values:
                store = self.stores.get(key, {})
                store.pop(obj, None)
                if not store:
                    self.stores.pop(key, None)

    def fold(self, ref, value):
        if value is None:
            return  # no result: the object keeps what it had
        values = dict(value) if isinstance(value, dict) else {None: value}
        self.remove(ref.uid)
        obj = (ref.namespace, ref.name, ref.uid)
        with self.lock:
            self.by_object[ref.uid] = (obj, values)
            for key, v in values.items():
                self.stores.setdefault(key, {})[obj] = v


# ----------------------------------------------------------------------------------------------
# One stream.

class Session:
    def __init__(self, process, number):
        self.process = process
        self.number = number
        self.out = queue.Queue()
        self.lock = threading.Lock()
        self.running = {}
        self.capabilities = set()
        self.accepted = set()
        self.welcomed = threading.Event()
        self.farewell = threading.Event()
        self.closed = threading.Event()
        self.active = True      # results are sent; False once the stream is lost
        self.half_closed = False
        self.code = None
        self.details = ""
        self.indexes = Index()
        self.channel = None
        self.call = None

    def send(self, message):
        with self.lock:
            if not self.active or self.half_closed:
                return False
            self.out.put(message)
            return True

    def close_send(self):
        with self.lock:
            if not self.half_closed:
                self.half_closed = True
                self.out.put(None)

    def requests(self):
        while True:
            message = self.out.get()
            if message is None:
                return
            yield message

    def finished(self, run, result):
        with self.lock:
            self.running.pop(run.id, None)
        outcome = result.WhichOneof("outcome")
        if self.send(rs.ConnectRequest(result=result)):
            log.info("invocation %s (%s): %s", run.id, run.handler_id, outcome)
        else:
            log.info("invocation %s (%s): %s, not sent (stream gone)", run.id, run.handler_id, outcome)

    def in_flight(self):
        with self.lock:
            return len(self.running)

    def runs(self):
        with self.lock:
            return list(self.running.values())

    def start(self):
        endpoint = self.process.endpoint
        self.channel = grpc.insecure_channel(endpoint, options=[
            ("grpc.max_send_message_length", SIXTEEN_MIB),
            ("grpc.max_receive_message_length", SIXTEEN_MIB),
            ("grpc.keepalive_time_ms", 30000),
            ("grpc.keepalive_timeout_ms", 10000),
            ("grpc.keepalive_permit_without_calls", 1),
            ("grpc.http2.max_pings_without_data", 0),
            ("grpc.enable_http_proxy", 0),
            ("grpc.enable_retries", 0),
        ])
        self.out.put(rs.ConnectRequest(hello=self.process.hello))
        for handler_id, limit in list(self.process.flow.items()):
            self.out.put(rs.ConnectRequest(flow_control=rs.FlowControl(handler_id=handler_id, max_in_flight=limit)))
        stub = rs_grpc.RuntimeServiceStub(self.channel)
        self.call = stub.Connect(self.requests())
        threading.Thread(target=self.read, name=f"reader-{self.number}", daemon=True).start()

    def read(self):
        try:
            for response in self.call:
                try:
                    self.dispatch(response)
                except Exception:  # noqa: BLE001 - one bad message never stops the reader
                    log.exception("could not handle a %s message", response.WhichOneof("message"))
            self.code, self.details = grpc.StatusCode.OK, ""
        except grpc.RpcError as error:
            self.code, self.details = error.code(), error.details() or ""
        except Exception:  # noqa: BLE001
            log.exception("the stream reader failed")
            self.code, self.details = grpc.StatusCode.UNKNOWN, "reader failed"
        finally:
            self.closed.set()

    def dispatch(self, response):
        which = response.WhichOneof("message")
        if which == "ping":
            self.send(rs.ConnectRequest(pong=rs.Pong(nonce=response.ping.nonce, in_flight=self.in_flight())))
        elif which == "invocation":
            run = Run(self, response.invocation)
            with self.lock:
                duplicate = run.id in self.running
                if not duplicate:
                    self.running[run.id] = run
            if duplicate:
                log.warning("invocation %s arrived twice: ignored", run.id)
                return
            log.info("invocation %s: %s attempt %d", run.id, run.handler_id, run.inv.attempt)
            run.start()
        elif which == "cancel":
            with self.lock:
                run = self.running.get(response.cancel.invocation_id)
            if run is None:
                log.info("cancel of %s, which is not running", response.cancel.invocation_id)
            else:
                run.cancel(iv.CancelReason.Name(response.cancel.reason) if response.cancel.reason in iv.CancelReason.values() else response.cancel.reason)
        elif which == "object_update":
            with self.lock:
                run = self.running.get(response.object_update.invocation_id)
            if run is not None and rs.CAPABILITY_OBJECT_UPDATES in self.capabilities:
                run.set_body(from_json(response.object_update, "body"))
        elif which == "welcome":
            self.welcome(response.welcome)
        elif which == "result_ack":
            ack = response.result_ack
            if not ack.accepted:
                log.warning("result of %s not accepted: %s", ack.invocation_id,
                            "; ".join(f"{d.reason}: {d.summary}" for d in ack.diagnostics))
        elif which == "notice":
            n = response.notice
            log.warning("notice (%s): %s", n.invocation_id or "process",
                        "; ".join(f"{d.reason}: {d.summary}" for d in n.diagnostics))
        elif which == "drain":
            log.info("the controller drains: %s", response.drain.reason)
        elif which == "farewell":
            log.info("farewell: %s", response.farewell.reason)
            self.farewell.set()
        elif which == "object_gone":
            pass
        else:
            log.info("ignored a message of an unknown kind")

    def welcome(self, welcome):
        self.capabilities = set(welcome.capabilities)
        for status in welcome.registrations:
            if status.accepted:
                self.accepted.add(status.handler_id)
            for d in status.diagnostics:
                log.log(logging.INFO if status.accepted else logging.WARNING, "handler %r %s: %s %s (%s)",
                        status.handler_id, "accepted" if status.accepted else "rejected",
                        d.reason, d.summary, d.field)
        log.info("welcome: connection %s, runtime %s %s, %d/%d handlers accepted", welcome.connection_id,
                 welcome.runtime.name, welcome.runtime.version, len(self.accepted), len(welcome.registrations))
        self.welcomed.set()

    def abandon(self):
        """The stream is gone: cancel what runs and drop its results."""
        with self.lock:
            self.active = False
            runs = list(self.running.values())
            self.running.clear()
        for run in runs:
            run.cancel("stream lost")
        self.close_send()
        try:
            self.call.cancel()
        except Exception:  # noqa: BLE001
            pass
        self.channel.close()


# ----------------------------------------------------------------------------------------------
# The process: reconnects, stops on SIGTERM.

class Process:
    def __init__(self):
        self.features = claimed_features()
        self.handler_ids = [h for h in ORDER if any(h in FEATURES[f] for f in self.features)]
        self.endpoint = os.environ.get("CAPSTAN_ENDPOINT") or "unix:///run/capstan/capstan.sock"
        for prefix in ("http://", "grpc://", "tcp://"):
            if self.endpoint.startswith(prefix):
                self.endpoint = self.endpoint[len(prefix):]
        self.instance_id = uuid.uuid4().hex
        # Flow-control caps set by handlers, by handler id ("" for the process): sent again on
        # every new stream, so that they hold across reconnects.
        self.flow = {}
        self.hello = rs.Hello(
            capabilities=capabilities(self.features),
            sdk=rs.SoftwareInfo(name="raw-grpcio", version=SDK_VERSION, language="python"),
            instance_id=self.instance_id,
            handlers=[registration(h) for h in self.handler_ids],
        )
        self.stop = threading.Event()

    def run(self):
        log.info("raw-grpcio %s: endpoint %s, features %s, handlers %s", self.instance_id, self.endpoint,
                 ",".join(sorted(self.features)), ",".join(self.handler_ids))
        failures = 0
        number = 0
        while not self.stop.is_set():
            number += 1
            session = Session(self, number)
            session.start()
            while not session.closed.wait(0.1):
                if self.stop.is_set():
                    self.shutdown(session)
                    return 0
            if self.stop.is_set():
                session.abandon()
                return 0
            session.abandon()
            code, details = session.code, session.details
            log.warning("stream %d ended: %s %s", number, code, details)
            if code == grpc.StatusCode.FAILED_PRECONDITION:
                reasons = set(re.findall(r"[A-Z][A-Z_]+[A-Z]", " ".join(re.findall(r"\[([^\]]*)\]", details))))
                if not reasons or reasons != {"HANDLER_ID_TAKEN"}:
                    log.error("rejected by the controller: %s", details)
                    return 1
            failures = 0 if session.welcomed.is_set() else failures + 1
            delay = min(BACKOFF_MAX, BACKOFF_MIN * (2 ** max(0, failures - 1))) if failures else BACKOFF_MIN
            delay = random.uniform(delay / 2, delay)
            log.info("reconnecting in %.2fs", delay)
            if self.stop.wait(delay):
                return 0
        return 0

    def shutdown(self, session):
        """Goodbye; the invocations running then get FINISH_WAIT, the cleanup invocations that
        a goodbye with `cleanup` brings run until the farewell (at most FAREWELL_WAIT); what
        still runs is cancelled and answered; then this side of the stream is closed."""
        log.info("stopping")
        if session.welcomed.is_set() and not session.closed.is_set():
            cleanup = rs.CAPABILITY_CLEANUP_ON_GOODBYE in session.capabilities and "cleanup" in session.accepted
            before = {run.id for run in session.runs()}
            session.send(rs.ConnectRequest(goodbye=rs.Goodbye(reason="SIGTERM", cleanup=cleanup)))
            start = time.monotonic()
            while not session.closed.is_set():
                elapsed = time.monotonic() - start
                waiting_farewell = cleanup and not session.farewell.is_set() and elapsed < FAREWELL_WAIT
                if elapsed >= FINISH_WAIT:
                    for run in session.runs():
                        if run.id in before:
                            run.cancel("stopping")
                if not waiting_farewell and (not session.in_flight() or elapsed >= FINISH_WAIT):
                    break
                time.sleep(0.05)
            for run in session.runs():
                run.cancel("stopping")
            deadline = time.monotonic() + CANCEL_WAIT
            while session.in_flight() and not session.closed.is_set() and time.monotonic() < deadline:
                time.sleep(0.05)
            for run in session.runs():  # those that ignore the cancel: cancelled all the same
                run.finish(iv.InvocationResult(cancelled=iv.Cancelled()))
        session.close_send()
        session.closed.wait(CLOSE_WAIT)
        session.abandon()
        log.info("stopped")


def main():
    logging.basicConfig(stream=sys.stderr, level=logging.INFO,
                        format="%(asctime)s %(levelname)s raw-grpcio: %(message)s")
    global grpc, cm, iv, rg, rs, rs_grpc
    cm, iv, rg, rs, rs_grpc = generate_stubs()
    import grpc as grpc_module
    grpc = grpc_module

    process = Process()

    def on_signal(signum, _frame):
        log.info("signal %d", signum)
        process.stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    code = process.run()
    logging.shutdown()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    main()

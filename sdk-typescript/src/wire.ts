// The one place where the SDK's own types meet the generated protocol types (with codec.ts, the
// hand-written coding of the hot path, used only here). A change of the
// generated code changes this file, never the public API.

import { create, fromBinary, toBinary } from "@bufbuild/protobuf";
import type { MessageInitShape } from "@bufbuild/protobuf";
import { durationFromMs, timestampDate, timestampFromDate } from "@bufbuild/protobuf/wkt";
import type { Timestamp } from "@bufbuild/protobuf/wkt";
import type { Json, Patch as PbPatch, Diagnostic as PbDiagnostic } from "./gen/capstan/v1/common_pb";
import { PatchTarget, PatchType, Severity } from "./gen/capstan/v1/common_pb";
import type { Invocation, InvocationResultSchema, SubhandlerOutcomeSchema } from "./gen/capstan/v1/invocation_pb";
import { Activity, CancelReason as PbCancelReason, ChangeReason, DiffOperation, EventType as PbEventType } from "./gen/capstan/v1/invocation_pb";
import type { FiltersSchema, HandlerRegistrationSchema, MetaMatchSchema, ValueMatchSchema } from "./gen/capstan/v1/registration_pb";
import { ErrorsMode as PbErrorsMode, HandlerKind, Operation as PbOperation, Presence } from "./gen/capstan/v1/registration_pb";
import { ConnectRequestSchema, ConnectResponseSchema, LogLevel as PbLogLevel, EventPosting } from "./gen/capstan/v1/runtime_service_pb";
import type { ConnectRequest, ConnectResponse } from "./gen/capstan/v1/runtime_service_pb";
import { encodeSuccessResult, fastInvocationResponse } from "./codec";
import type { InvocationData, LogOut } from "./context";
import type { CancelReason } from "./errors";
import type { HandlerSpec } from "./registry";
import { ABSENT, PRESENT } from "./types";
import type {
  Credentials,
  Diagnostic,
  DiffItem,
  DiffOperation as OwnDiffOperation,
  InvocationOutcome,
  Kind,
  LogLevel,
  Outcome,
  PatchDocument,
} from "./types";

export { ConnectRequestSchema, ConnectResponseSchema };
export type { ConnectRequest, ConnectResponse };

/** Marks a plain successful result that {@link encodeRequest} writes by hand (codec.ts). */
const PLAIN_SUCCESS = Symbol("capstan.plainSuccess");

/** Encodes a ConnectRequest for the wire. */
export function encodeRequest(m: ConnectRequest): Buffer {
  if (Buffer.isBuffer(m)) return m; // encoded already (see Session.send)
  let bytes: Uint8Array | undefined;
  if ((m as { [PLAIN_SUCCESS]?: true })[PLAIN_SUCCESS] && m.message.case === "result") {
    const r = m.message.value;
    const oc = r.outcome;
    if (oc.case === "success" && r.duration) bytes = encodeSuccessResult(r.invocationId, oc.value.result, r.patches, r.duration);
  }
  bytes ??= toBinary(ConnectRequestSchema, m);
  return Buffer.from(bytes.buffer, bytes.byteOffset, bytes.byteLength);
}

/**
 * Decodes a ConnectResponse; unknown fields are kept aside, unknown enum values kept as numbers.
 * An invocation, the message that comes most, is decoded by hand (codec.ts).
 */
export function decodeResponse(b: Buffer): ConnectResponse {
  return fastInvocationResponse(b) ?? fromBinary(ConnectResponseSchema, b);
}

/** Decodes a ConnectRequest (the fake controller of the tests). */
export function decodeRequest(b: Buffer): ConnectRequest {
  return fromBinary(ConnectRequestSchema, b);
}

/** Encodes a ConnectResponse (the fake controller of the tests). */
export function encodeResponse(m: ConnectResponse): Buffer {
  const bytes = toBinary(ConnectResponseSchema, m);
  return Buffer.from(bytes.buffer, bytes.byteOffset, bytes.byteLength);
}

/** Builds a ConnectRequest from its init shape. */
export function request(init: MessageInitShape<typeof ConnectRequestSchema>): ConnectRequest {
  return create(ConnectRequestSchema, init);
}

/** Builds a ConnectResponse from its init shape. */
export function response(init: MessageInitShape<typeof ConnectResponseSchema>): ConnectResponse {
  return create(ConnectResponseSchema, init);
}

const decoder = new TextDecoder("utf-8", { fatal: true });
const encoder = new TextEncoder();

/** Decodes a Json message; an unset one is undefined. Throws on malformed JSON. */
export function decodeJson(j: Json | undefined): unknown {
  if (!j) return undefined;
  return JSON.parse(decoder.decode(j.json));
}

/** Encodes a value as a Json message's init. */
export function encodeJson(v: unknown): { json: Uint8Array } {
  return { json: encoder.encode(JSON.stringify(v)) };
}

function seconds(v: number | undefined) {
  return v === undefined ? undefined : durationFromMs(Math.round(v * 1000));
}

/** The longest retry delay a result may ask for: 365 days, in seconds. */
export const MAX_RETRY_DELAY = 365 * 24 * 3600;

/** A TemporaryError's delay on the wire; throws unless it is finite and within 0..365 days. */
function retryDelay(v: number | undefined) {
  if (v === undefined) return undefined;
  if (typeof v !== "number" || !Number.isFinite(v) || v < 0 || v > MAX_RETRY_DELAY) {
    throw new RangeError(`capstan: a retry delay must be a finite number of seconds within 0..${MAX_RETRY_DELAY}, not ${String(v)}`);
  }
  return seconds(v);
}

/** An admission status code on the wire; throws unless it is an int32. */
function admissionCode(v: number | undefined): number {
  if (v === undefined) return 0;
  if (!Number.isInteger(v) || v < -(2 ** 31) || v > 2 ** 31 - 1) {
    throw new RangeError(`capstan: an admission code must be a 32-bit integer, not ${String(v)}`);
  }
  return v;
}

const KINDS: Record<Kind, HandlerKind> = {
  create: HandlerKind.CREATE,
  update: HandlerKind.UPDATE,
  delete: HandlerKind.DELETE,
  resume: HandlerKind.RESUME,
  field: HandlerKind.FIELD,
  event: HandlerKind.EVENT,
  index: HandlerKind.INDEX,
  daemon: HandlerKind.DAEMON,
  timer: HandlerKind.TIMER,
  startup: HandlerKind.STARTUP,
  cleanup: HandlerKind.CLEANUP,
  login: HandlerKind.LOGIN,
  probe: HandlerKind.PROBE,
  validate: HandlerKind.VALIDATE,
  mutate: HandlerKind.MUTATE,
};

const ERRORS = { temporary: PbErrorsMode.TEMPORARY, permanent: PbErrorsMode.PERMANENT, ignored: PbErrorsMode.IGNORED };
const OPERATIONS: Record<string, PbOperation> = {
  CREATE: PbOperation.CREATE,
  UPDATE: PbOperation.UPDATE,
  DELETE: PbOperation.DELETE,
  CONNECT: PbOperation.CONNECT,
};

function metaMatch(v: unknown): MessageInitShape<typeof MetaMatchSchema> {
  if (v === PRESENT) return { condition: { case: "presence", value: Presence.PRESENT } };
  if (v === ABSENT) return { condition: { case: "presence", value: Presence.ABSENT } };
  return { condition: { case: "equals", value: String(v) } };
}

function valueMatch(v: unknown): MessageInitShape<typeof ValueMatchSchema> | undefined {
  if (v === undefined) return undefined;
  if (v === PRESENT) return { condition: { case: "presence", value: Presence.PRESENT } };
  if (v === ABSENT) return { condition: { case: "presence", value: Presence.ABSENT } };
  return { condition: { case: "equals", value: encodeJson(v) } };
}

/** The wire registration of a handler. */
export function registration(spec: HandlerSpec): MessageInitShape<typeof HandlerRegistrationSchema> {
  const o = spec.options;
  const reg: MessageInitShape<typeof HandlerRegistrationSchema> = {
    handlerId: spec.id,
    kind: KINDS[spec.kind],
    errorsMode: o.errors ? ERRORS[o.errors] : PbErrorsMode.UNSPECIFIED,
    retries: o.retries ?? 0,
    backoff: seconds(o.backoff),
    timeout: seconds(o.timeout),
    maxInFlight: o.maxInFlight ?? 0,
  };
  if (spec.resource) {
    reg.resource = {
      group: spec.resource.group,
      version: spec.resource.version,
      name: spec.resource.name,
      labelSelector: spec.resource.labelSelector,
      fieldSelector: spec.resource.fieldSelector,
    };
  }
  if (o.param !== undefined) reg.param = encodeJson(o.param);
  const filters: MessageInitShape<typeof FiltersSchema> = {
    field: o.field ?? "",
    sdkWhen: typeof o.when === "function",
    value: valueMatch(o.value),
    old: valueMatch(o.old),
    new: valueMatch(o.new),
  };
  let any = Boolean(filters.field || filters.sdkWhen || filters.value || filters.old || filters.new);
  if (o.labels && Object.keys(o.labels).length) {
    filters.labels = Object.fromEntries(Object.entries(o.labels).map(([k, v]) => [k, metaMatch(v)]));
    any = true;
  }
  if (o.annotations && Object.keys(o.annotations).length) {
    filters.annotations = Object.fromEntries(Object.entries(o.annotations).map(([k, v]) => [k, metaMatch(v)]));
    any = true;
  }
  if (any) reg.filters = filters;
  switch (spec.kind) {
    case "daemon":
      reg.kindOptions = {
        case: "daemon",
        value: {
          initialDelay: seconds(o.initialDelay),
          cancellationBackoff: seconds(o.cancellationBackoff),
          cancellationTimeout: seconds(o.cancellationTimeout),
          restartBackoff: seconds(o.restartBackoff),
          noRestartAfterSuccess: o.noRestartAfterSuccess ?? false,
        },
      };
      break;
    case "timer":
      reg.kindOptions = {
        case: "timer",
        value: { interval: seconds(o.interval), initialDelay: seconds(o.initialDelay), idle: seconds(o.idle), sharp: o.sharp ?? false },
      };
      break;
    case "delete":
      if (o.optional) reg.kindOptions = { case: "delete", value: { optional: true } };
      break;
    case "resume":
      if (o.deleted) reg.kindOptions = { case: "resume", value: { deleted: true } };
      break;
    case "validate":
    case "mutate":
      reg.kindOptions = {
        case: "admission",
        value: {
          operations: (o.operations ?? []).map((op) => OPERATIONS[op] ?? PbOperation.UNSPECIFIED),
          subresource: o.subresource ?? "",
          sideEffects: o.sideEffects ?? false,
          ignoreFailures: o.ignoreFailures ?? false,
        },
      };
      break;
    default:
  }
  return reg;
}

const REASONS: Partial<Record<ChangeReason, InvocationData["reason"]>> = {
  [ChangeReason.CREATE]: "create",
  [ChangeReason.UPDATE]: "update",
  [ChangeReason.DELETE]: "delete",
  [ChangeReason.RESUME]: "resume",
};
const DIFF_OPS: Partial<Record<DiffOperation, OwnDiffOperation>> = {
  [DiffOperation.ADD]: "add",
  [DiffOperation.CHANGE]: "change",
  [DiffOperation.REMOVE]: "remove",
};
const EVENT_TYPES: Partial<Record<PbEventType, InvocationData["eventType"]>> = {
  [PbEventType.ADDED]: "ADDED",
  [PbEventType.MODIFIED]: "MODIFIED",
  [PbEventType.DELETED]: "DELETED",
};
const ACTIVITIES: Partial<Record<Activity, InvocationData["activity"]>> = {
  [Activity.STARTUP]: "startup",
  [Activity.CLEANUP]: "cleanup",
  [Activity.LOGIN]: "login",
};

function date(t: Timestamp | undefined): Date | undefined {
  return t ? timestampDate(t) : undefined;
}

function diagnostic(d: PbDiagnostic | undefined): Diagnostic | undefined {
  if (!d) return undefined;
  return { summary: d.summary, detail: d.detail || undefined, reason: d.reason || undefined, errorType: d.errorType || undefined };
}

/** Decodes an Invocation into the SDK's form. Throws on malformed JSON. */
export function invocationData(m: Invocation, kind: Kind): InvocationData {
  const data: InvocationData = {
    invocationId: m.invocationId,
    handlerId: m.handlerId,
    kind,
    attempt: Math.max(m.attempt, 1),
    idempotencyKey: m.idempotencyKey,
    started: date(m.startedTime) ?? new Date(),
    deadline: date(m.deadline),
    lastError: diagnostic(m.lastError),
    traceparent: m.traceContext["traceparent"],
  };
  if (m.resource) {
    const r = m.resource;
    data.resource = {
      group: r.group,
      version: r.version,
      kind: r.kind,
      plural: r.plural,
      namespace: r.namespace,
      name: r.name,
      uid: r.uid,
      resourceVersion: r.resourceVersion,
      generation: Number(r.generation),
    };
  }
  const body = decodeJson(m.body);
  if (body && typeof body === "object" && !Array.isArray(body)) data.body = body as InvocationData["body"];
  data.param = decodeJson(m.param);
  data.subhandlers = m.subhandlers.map((s) => ({
    id: s.subhandlerId,
    retries: s.retries,
    success: s.success,
    failure: s.failure,
    delayedUntil: date(s.delayedUntil),
    message: s.message || undefined,
    started: date(s.startedTime),
  }));
  const p = m.payload;
  switch (p.case) {
    case "change": {
      data.reason = REASONS[p.value.reason];
      data.field = p.value.field || undefined;
      data.old = decodeJson(p.value.old) ?? null;
      data.new = decodeJson(p.value.new) ?? null;
      data.diff = p.value.diff.map(
        (d): DiffItem => [DIFF_OPS[d.operation] ?? "change", [...d.path], decodeJson(d.old) ?? null, decodeJson(d.new) ?? null],
      );
      break;
    }
    case "event":
      data.eventType = EVENT_TYPES[p.value.type];
      break;
    case "daemon":
      data.restarts = p.value.restarts;
      break;
    case "timer":
      data.scheduled = date(p.value.scheduledTime);
      break;
    case "index":
      data.indexDeleted = p.value.deleted;
      break;
    case "admission":
      data.admission = {
        uid: p.value.uid,
        operation: p.value.operation,
        subresource: p.value.subresource,
        dryRun: p.value.dryRun,
        oldObject: decodeJson(p.value.oldObject) ?? null,
        userInfo: decodeJson(p.value.userInfo) ?? null,
        headers: { ...p.value.headers },
      };
      break;
    case "activity":
      data.activity = ACTIVITIES[p.value.activity];
      break;
    default:
  }
  return data;
}

const CANCEL_REASONS: Partial<Record<PbCancelReason, CancelReason>> = {
  [PbCancelReason.RESOURCE_DELETED]: "resource_deleted",
  [PbCancelReason.FILTER_MISMATCH]: "filter_mismatch",
  [PbCancelReason.DEADLINE_EXCEEDED]: "deadline_exceeded",
  [PbCancelReason.SUPERSEDED]: "superseded",
  [PbCancelReason.RUNTIME_SHUTDOWN]: "runtime_shutdown",
  [PbCancelReason.HANDLER_UNREGISTERED]: "handler_unregistered",
  [PbCancelReason.PAUSED]: "paused",
};

export function cancelReason(r: PbCancelReason): CancelReason {
  return CANCEL_REASONS[r] ?? "unspecified";
}

function pbDiagnostic(d: Diagnostic, stack?: string): MessageInitShape<typeof import("./gen/capstan/v1/common_pb").DiagnosticSchema> {
  return {
    severity: Severity.ERROR,
    summary: d.summary,
    detail: d.detail ?? "",
    reason: d.reason ?? "",
    errorType: d.errorType ?? "",
    stackTrace: stack ?? "",
  };
}

function bytes(v: Uint8Array | string | undefined): Uint8Array {
  if (v === undefined) return new Uint8Array();
  return typeof v === "string" ? encoder.encode(v) : v;
}

function credentials(c: Credentials) {
  return {
    server: c.server ?? "",
    certificateAuthority: bytes(c.certificateAuthority),
    insecure: c.insecure ?? false,
    username: c.username ?? "",
    password: c.password ?? "",
    token: c.token ?? "",
    clientCertificate: bytes(c.clientCertificate),
    clientKey: bytes(c.clientKey),
    defaultNamespace: c.defaultNamespace ?? "",
    expirationTime: c.expiration ? timestampFromDate(c.expiration) : undefined,
    priority: c.priority ?? 0,
  };
}

function successInit(o: Extract<Outcome, { status: "success" }>) {
  const value: MessageInitShape<typeof import("./gen/capstan/v1/invocation_pb").SuccessSchema> = {};
  if (o.result !== undefined && o.result !== null) value.result = encodeJson(o.result);
  if (o.admission) {
    value.kindResult = {
      case: "admission",
      value: { allowed: o.admission.allowed, message: o.admission.message ?? "", code: admissionCode(o.admission.code), warnings: o.admission.warnings },
    };
  } else if (o.credentials) {
    value.kindResult = { case: "credentials", value: credentials(o.credentials) };
  }
  return value;
}

type ResultOutcome = MessageInitShape<typeof InvocationResultSchema>["outcome"];

function outcomeInit(o: Outcome): ResultOutcome {
  switch (o.status) {
    case "success":
      return { case: "success", value: successInit(o) };
    case "temporary":
      return { case: "temporaryError", value: { retryAfter: retryDelay(o.delay), diagnostics: [pbDiagnostic(o.diagnostic)] } };
    case "permanent":
      return { case: "permanentError", value: { diagnostics: [pbDiagnostic(o.diagnostic)] } };
    case "unclassified":
      return { case: "unclassifiedError", value: { diagnostics: [pbDiagnostic(o.diagnostic, o.stack)] } };
    case "cancelled":
      return { case: "cancelled", value: {} };
    case "skipped":
      return { case: "skipped", value: {} };
  }
}

function patchInit(p: PatchDocument): MessageInitShape<typeof import("./gen/capstan/v1/common_pb").PatchSchema> {
  return {
    type: p.type === "json" ? PatchType.JSON : PatchType.MERGE,
    target: p.target === "status" ? PatchTarget.STATUS : PatchTarget.OBJECT,
    body: encodeJson(p.body),
  };
}

/** The wire result of an invocation. */
export function resultRequest(invocationId: string, r: InvocationOutcome): ConnectRequest {
  const o = r.outcome;
  if (o.status === "success" && !o.admission && !o.credentials && r.subhandlers.length === 0) return plainSuccess(invocationId, o.result, r);
  const subhandlers: MessageInitShape<typeof SubhandlerOutcomeSchema>[] = r.subhandlers.map((s) => {
    const so = s.outcome;
    if (so.status === "deferred") return { subhandlerId: s.id, outcome: { case: "deferred", value: {} } };
    const init = outcomeInit(so) as { case: string; value: unknown };
    if (init.case === "cancelled" || init.case === "skipped") {
      return { subhandlerId: s.id, outcome: { case: "deferred", value: {} } };
    }
    return { subhandlerId: s.id, outcome: init } as MessageInitShape<typeof SubhandlerOutcomeSchema>;
  });
  return request({
    message: {
      case: "result",
      value: {
        invocationId,
        outcome: outcomeInit(r.outcome),
        patches: r.outcome.status === "success" ? r.patches.map(patchInit) : [],
        duration: durationFromMs(Math.max(Math.round(r.duration * 1000), 0)),
        subhandlers,
      },
    },
  });
}

/**
 * A successful result without sub-handlers or a kind result, built as plain objects of the
 * generated types' shape (no reflective `create`) and marked for {@link encodeRequest}.
 */
function plainSuccess(invocationId: string, result: unknown, r: InvocationOutcome): ConnectRequest {
  const ms = Math.max(Math.round(r.duration * 1000), 0);
  const seconds = Math.floor(ms / 1000);
  const m = {
    $typeName: "capstan.v1.ConnectRequest",
    message: {
      case: "result",
      value: {
        $typeName: "capstan.v1.InvocationResult",
        invocationId,
        outcome: {
          case: "success",
          value: {
            $typeName: "capstan.v1.Success",
            result: result !== undefined && result !== null ? { $typeName: "capstan.v1.Json", ...encodeJson(result) } : undefined,
            kindResult: { case: undefined },
          },
        },
        patches: r.patches.map((p) => ({
          $typeName: "capstan.v1.Patch",
          type: p.type === "json" ? PatchType.JSON : PatchType.MERGE,
          target: p.target === "status" ? PatchTarget.STATUS : PatchTarget.OBJECT,
          body: { $typeName: "capstan.v1.Json", ...encodeJson(p.body) },
        })),
        duration: { $typeName: "google.protobuf.Duration", seconds: BigInt(seconds), nanos: (ms - seconds * 1000) * 1_000_000 },
        subhandlers: [],
      },
    },
    [PLAIN_SUCCESS]: true,
  };
  return m as unknown as ConnectRequest;
}

/** A permanent error for an invocation that cannot run. */
export function rejection(invocationId: string, reason: string, summary: string): ConnectRequest {
  return request({
    message: {
      case: "result",
      value: {
        invocationId,
        outcome: { case: "permanentError", value: { diagnostics: [{ severity: Severity.ERROR, summary, reason }] } },
      },
    },
  });
}

const LEVELS: Record<LogLevel, PbLogLevel> = {
  debug: PbLogLevel.DEBUG,
  info: PbLogLevel.INFO,
  warning: PbLogLevel.WARNING,
  error: PbLogLevel.ERROR,
};

/** The wire log record. */
export function logRequest(r: LogOut): ConnectRequest {
  return request({
    message: {
      case: "log",
      value: {
        invocationId: r.invocationId,
        level: LEVELS[r.level],
        message: r.message,
        time: timestampFromDate(r.time),
        posting: r.event ? EventPosting.ALWAYS : EventPosting.UNSPECIFIED,
        reason: r.event?.reason ?? "",
        eventType: r.event?.type ?? "",
      },
    },
  });
}

/** The wire interim update of a running invocation. */
export function updateRequest(invocationId: string, patches: PatchDocument[]): ConnectRequest {
  return request({ message: { case: "update", value: { invocationId, patches: patches.map(patchInit) } } });
}

export type { PbPatch };

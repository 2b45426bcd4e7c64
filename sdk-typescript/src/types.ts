// The SDK's own public types. Generated protocol types never appear in the public API.

/** A JSON object, as decoded from the wire. */
export type JsonObject = { [key: string]: unknown };

/** The kinds of handlers (kopf's decorators). */
export type Kind =
  | "create"
  | "update"
  | "delete"
  | "resume"
  | "field"
  | "event"
  | "index"
  | "daemon"
  | "timer"
  | "startup"
  | "cleanup"
  | "login"
  | "probe"
  | "validate"
  | "mutate";

/** kopf's cause reasons of change and field handlers. */
export type Reason = "create" | "update" | "delete" | "resume";

/** A watch event's type; `undefined` on an event handler's context means the initial listing. */
export type EventType = "ADDED" | "MODIFIED" | "DELETED";

/** An operation of an admission review. */
export type Operation = "CREATE" | "UPDATE" | "DELETE" | "CONNECT";

/** The log levels of log records. */
export type LogLevel = "debug" | "info" | "warning" | "error";

/** kopf's errors modes: what an error of no kopf class means. */
export type ErrorsMode = "temporary" | "permanent" | "ignored";

/** A diff operation. */
export type DiffOperation = "add" | "change" | "remove";

/** One difference, as kopf gives it: `[operation, path, old, new]`. */
export type DiffItem = readonly [operation: DiffOperation, path: readonly string[], old: unknown, new: unknown];

/** kopf's diff: a list of differences. */
export type Diff = readonly DiffItem[];

/**
 * Which resource a handler is for: a name as kubectl takes it (`"widgets"`,
 * `"widgets.conformance.capstan.dev"`, `"widgets.v1.conformance.capstan.dev"`, a kind, a short
 * name), or its parts.
 */
export type ResourceSpec =
  | string
  | {
      group?: string;
      version?: string;
      /** Plural, singular, kind, short name or category. */
      plural?: string;
      name?: string;
      /** A Kubernetes label selector limiting what is watched. */
      labelSelector?: string;
      /** A Kubernetes field selector limiting what is watched. */
      fieldSelector?: string;
    };

/** The object an invocation is about. */
export interface ResourceRef {
  group: string;
  version: string;
  kind: string;
  plural: string;
  namespace: string;
  name: string;
  uid: string;
  resourceVersion: string;
  generation: number;
}

/** A diagnostic: why something failed. */
export interface Diagnostic {
  summary: string;
  detail?: string;
  reason?: string;
  errorType?: string;
}

/** A label or annotation filter: a value, or presence (`PRESENT`/`ABSENT`). */
export type MetaFilter = string | typeof PRESENT | typeof ABSENT;

/** A value filter of `value`, `old` and `new`: a JSON value, or presence. */
export type ValueFilter = unknown;

/** kopf's `kopf.PRESENT`. */
export const PRESENT: unique symbol = Symbol("PRESENT");
/** kopf's `kopf.ABSENT`. */
export const ABSENT: unique symbol = Symbol("ABSENT");

/** The credentials a login handler returns (kopf's `ConnectionInfo`). */
export interface Credentials {
  server?: string;
  certificateAuthority?: Uint8Array | string;
  insecure?: boolean;
  username?: string;
  password?: string;
  token?: string;
  clientCertificate?: Uint8Array | string;
  clientKey?: Uint8Array | string;
  defaultNamespace?: string;
  expiration?: Date;
  priority?: number;
}

/** The request of a validating or mutating handler. */
export interface AdmissionRequest {
  uid: string;
  operation: Operation | string;
  subresource: string;
  dryRun: boolean;
  oldObject: unknown;
  userInfo: unknown;
  headers: Record<string, string>;
}

/** An admission verdict: what an admission handler answers. */
export interface AdmissionVerdict {
  allowed: boolean;
  message?: string;
  code?: number;
  warnings: string[];
}

/** A patch as sent to the controller. */
export interface PatchDocument {
  /** `merge`: an RFC 7386 merge patch object; `json`: an RFC 6902 operation list. */
  type: "merge" | "json";
  /** `object` (metadata, spec) or `status` (the status subresource). */
  target: "object" | "status";
  body: unknown;
}

/** The state of a sub-handler that earlier attempts reported. */
export interface SubhandlerState {
  id: string;
  retries: number;
  success: boolean;
  failure: boolean;
  delayedUntil?: Date;
  message?: string;
  started?: Date;
}

/** How one call of a handler ended. */
export type Outcome =
  | { status: "success"; result?: unknown; admission?: AdmissionVerdict; credentials?: Credentials }
  | { status: "temporary"; message: string; delay?: number; diagnostic: Diagnostic }
  | { status: "permanent"; message: string; diagnostic: Diagnostic }
  | { status: "unclassified"; message: string; diagnostic: Diagnostic; stack?: string }
  | { status: "cancelled" }
  | { status: "skipped" };

/** The outcome of one sub-handler. */
export interface SubhandlerOutcome {
  id: string;
  outcome: Outcome | { status: "deferred" };
}

/** What one invocation produced: its outcome, patches and sub-handlers. */
export interface InvocationOutcome {
  outcome: Outcome;
  patches: PatchDocument[];
  subhandlers: SubhandlerOutcome[];
  /** Seconds the handler ran. */
  duration: number;
}

// kopf's handler arguments, as one typed object handed to every handler.

import { longTimeout } from "./timers";
import { PermanentError } from "./errors";
import type { CancelReason } from "./errors";
import { Index, Indexes } from "./indexes";
import type { Memo, Memos } from "./memo";
import { Patch } from "./patch";
import type {
  AdmissionRequest,
  Diagnostic,
  Diff,
  EventType,
  JsonObject,
  Kind,
  LogLevel,
  PatchDocument,
  Reason,
  ResourceRef,
  SubhandlerState,
} from "./types";
import type { HandlerFn, SubhandlerOptions } from "./registry";

/** Everything an invocation carries, decoded (the SDK's own form of `Invocation`). */
export interface InvocationData {
  invocationId: string;
  handlerId: string;
  kind: Kind;
  attempt: number;
  idempotencyKey: string;
  started: Date;
  deadline?: Date;
  resource?: ResourceRef;
  body?: JsonObject;
  param?: unknown;
  lastError?: Diagnostic;
  traceparent?: string;
  reason?: Reason;
  old?: unknown;
  new?: unknown;
  diff?: Diff;
  field?: string;
  eventType?: EventType;
  restarts?: number;
  scheduled?: Date;
  indexDeleted?: boolean;
  admission?: AdmissionRequest;
  activity?: "startup" | "cleanup" | "login";
  subhandlers?: SubhandlerState[];
}

/** A log record of an invocation, as it goes to the controller. */
export interface LogOut {
  invocationId: string;
  level: LogLevel;
  message: string;
  time: Date;
  /** Set when the record is to be posted as a Kubernetes Event. */
  event?: { reason: string; type: string };
}

/** Where an invocation sends its log records and interim patches. */
export interface Sink {
  log(record: LogOut): void;
  update(invocationId: string, patches: PatchDocument[]): void;
  /** The SDK's local log. */
  local?: import("./logger").Logger;
}

/** The handler's logger (kopf's `logger`): each record goes to the controller, tied to the invocation. */
export interface HandlerLogger {
  debug(message: string): void;
  info(message: string): void;
  warning(message: string): void;
  /** The same as `warning`. */
  warn(message: string): void;
  error(message: string): void;
  log(level: LogLevel, message: string): void;
}

/** A sub-handler declared with {@link Context.register}. */
export interface DeclaredSubhandler {
  id: string;
  fn: HandlerFn;
  options: SubhandlerOptions;
}

/**
 * @internal An invocation's AbortController, made on first use: creating an AbortSignal costs
 * microseconds, and most invocations end without anyone looking at theirs.
 */
export class LazyAbort {
  private controller: AbortController | undefined;

  get signal(): AbortSignal {
    return (this.controller ??= new AbortController()).signal;
  }

  get aborted(): boolean {
    return this.controller?.signal.aborted ?? false;
  }

  abort(reason: unknown): void {
    (this.controller ??= new AbortController()).abort(reason);
  }
}

const CHANGE_KINDS: ReadonlySet<Kind> = new Set(["create", "update", "delete", "resume", "field"]);

function section(obj: unknown, key: string): JsonObject {
  if (obj && typeof obj === "object") {
    const v = (obj as JsonObject)[key];
    if (v && typeof v === "object" && !Array.isArray(v)) return v as JsonObject;
  }
  return {};
}

/**
 * What a handler is given: kopf's keyword arguments as the properties of one object. Destructure
 * what you need:
 *
 * ```ts
 * on.create("widgets.v1.example.com", async ({ spec, name, patch, logger }) => { … });
 * ```
 */
export class Context {
  /** kopf's `patch`: changes to the object, sent with a successful result. */
  readonly patch = new Patch();
  /** The warnings an admission handler returns with its verdict (kopf's `warnings`). */
  readonly warnings: string[] = [];
  /** kopf's `logger`: records sent to the controller, tied to this invocation. */
  readonly logger: HandlerLogger;
  private bodyValue: JsonObject;
  private memoValue: Memo | undefined;
  private declared: DeclaredSubhandler[] = [];
  private canDeclare: boolean;
  /** @internal */ cancelReasonValue: CancelReason | undefined;

  /** @internal */
  constructor(
    /** @internal */ readonly data: InvocationData,
    signal: AbortSignal | LazyAbort,
    /** @internal */ readonly sink: Sink,
    private readonly memos: Memos | undefined,
    private readonly indexStore: Indexes | undefined,
    started?: Date,
  ) {
    this.signalSource = signal;
    this.bodyValue = data.body ?? {};
    this.canDeclare = CHANGE_KINDS.has(data.kind);
    this.startedValue = started ?? data.started;
    const log = (level: LogLevel, message: string) => this.log(level, message);
    this.logger = {
      debug: (m) => log("debug", m),
      info: (m) => log("info", m),
      warning: (m) => log("warning", m),
      warn: (m) => log("warning", m),
      error: (m) => log("error", m),
      log,
    };
    // Methods work destructured too: `({ event, register }) => …`.
    this.event = this.event.bind(this);
    this.info = this.info.bind(this);
    this.warn = this.warn.bind(this);
    this.exception = this.exception.bind(this);
    this.register = this.register.bind(this);
    this.index = this.index.bind(this);
    this.sendPatch = this.sendPatch.bind(this);
    this.sleep = this.sleep.bind(this);
  }
  private readonly startedValue: Date;
  private readonly signalSource: AbortSignal | LazyAbort;

  /** kopf's `stopped`/cancellation: aborted when the controller cancels the invocation, its deadline passes, the stream is lost or the process stops. */
  get signal(): AbortSignal {
    const s = this.signalSource;
    return s instanceof LazyAbort ? s.signal : s;
  }

  /** The invocation id (unique per attempt). */
  get invocationId(): string {
    return this.data.invocationId;
  }
  /** The handler's id (`parent/child` for sub-handlers). */
  get handlerId(): string {
    return this.data.handlerId;
  }
  /** The handler's kind. */
  get kind(): Kind {
    return this.data.kind;
  }
  /** Stable across all attempts of the same work: use it for idempotent side effects. */
  get idempotencyKey(): string {
    return this.data.idempotencyKey;
  }
  /** The 1-based attempt number. */
  get attempt(): number {
    return this.data.attempt;
  }
  /** kopf's `retry`: the number of attempts before this one. */
  get retry(): number {
    return Math.max(this.data.attempt - 1, 0);
  }
  /** kopf's `started`: when the first attempt started. */
  get started(): Date {
    return this.startedValue;
  }
  /** kopf's `runtime`: seconds since the first attempt started. */
  get runtime(): number {
    return (Date.now() - this.startedValue.getTime()) / 1000;
  }
  /** When this attempt should end (the signal is aborted then), if the controller set it. */
  get deadline(): Date | undefined {
    return this.data.deadline;
  }
  /** The previous attempt's failure. */
  get lastError(): Diagnostic | undefined {
    return this.data.lastError;
  }
  /** The W3C `traceparent` of this invocation; pass it on to continue the trace. */
  get traceparent(): string | undefined {
    return this.data.traceparent;
  }
  /** The registration's `param`. */
  get param(): unknown {
    return this.data.param ?? null;
  }

  /** The object's reference (undefined for activities and probes). */
  get resource(): ResourceRef | undefined {
    return this.data.resource;
  }
  /** kopf's `body`: the latest body (a daemon sees the bodies of object updates). */
  get body(): JsonObject {
    return this.bodyValue;
  }
  /** kopf's `spec`. */
  get spec(): JsonObject {
    return section(this.bodyValue, "spec");
  }
  /** kopf's `meta`. */
  get meta(): JsonObject {
    return section(this.bodyValue, "metadata");
  }
  /** kopf's `status`. */
  get status(): JsonObject {
    return section(this.bodyValue, "status");
  }
  /** The object's labels. */
  get labels(): Record<string, string> {
    return section(this.meta, "labels") as Record<string, string>;
  }
  /** The object's annotations. */
  get annotations(): Record<string, string> {
    return section(this.meta, "annotations") as Record<string, string>;
  }
  /** kopf's `name`. */
  get name(): string | undefined {
    return this.data.resource?.name || (this.meta.name as string | undefined) || undefined;
  }
  /** kopf's `namespace` (undefined for cluster-scoped objects). */
  get namespace(): string | undefined {
    return this.data.resource?.namespace || (this.meta.namespace as string | undefined) || undefined;
  }
  /** kopf's `uid`. */
  get uid(): string | undefined {
    return this.data.resource?.uid || (this.meta.uid as string | undefined) || undefined;
  }

  /** kopf's `reason` of change and field handlers. */
  get reason(): Reason | undefined {
    return this.data.reason;
  }
  /** kopf's `old` (change and field handlers). */
  get old(): unknown {
    return this.data.old ?? null;
  }
  /** kopf's `new` (change and field handlers). */
  get new(): unknown {
    return this.data.new ?? null;
  }
  /** kopf's `diff` (change and field handlers; empty for other kinds). */
  get diff(): Diff {
    return this.data.diff ?? [];
  }
  /** The dotted path of a field handler's field. */
  get field(): string | undefined {
    return this.data.field;
  }
  /** kopf's `type` of event handlers; undefined for an object of the initial listing. */
  get type(): EventType | undefined {
    return this.data.eventType;
  }
  /** How often a daemon was restarted for this object. */
  get restarts(): number {
    return this.data.restarts ?? 0;
  }
  /** When a timer's tick was scheduled. */
  get scheduled(): Date | undefined {
    return this.data.scheduled;
  }
  /** The review of a validating or mutating handler. */
  get admission(): AdmissionRequest | undefined {
    return this.data.admission;
  }
  /** kopf's `operation` (admission). */
  get operation(): string | undefined {
    return this.data.admission?.operation;
  }
  /** kopf's `dryrun` (admission). */
  get dryRun(): boolean | undefined {
    return this.data.admission?.dryRun;
  }
  /** kopf's `subresource` (admission). */
  get subresource(): string | undefined {
    return this.data.admission?.subresource || undefined;
  }
  /** kopf's `userinfo` (admission). */
  get userInfo(): unknown {
    return this.data.admission?.userInfo;
  }
  /** The activity of a startup, cleanup or login handler. */
  get activity(): "startup" | "cleanup" | "login" | undefined {
    return this.data.activity;
  }
  /** Why the invocation was cancelled; undefined while it is not. */
  get cancelReason(): CancelReason | undefined {
    return this.cancelReasonValue;
  }

  /**
   * kopf's `memo`: values kept in this process for the object across the calls of all its
   * handlers, starting as a shallow copy of the operator-wide memo. Activities get the
   * operator-wide memo itself. Dropped when the object is gone.
   */
  get memo(): Memo {
    if (!this.memoValue) this.memoValue = this.memos ? this.memos.get(this.uid ?? "") : {};
    return this.memoValue;
  }

  /** The indexes of this process (kopf's index kwargs), by index handler id. */
  get indexes(): Record<string, Index> {
    const out: Record<string, Index> = {};
    for (const name of this.indexStore?.names() ?? []) out[name] = this.indexStore!.get(name)!;
    return out;
  }

  /** The index of the index handler `name`; a {@link PermanentError} when there is none. */
  index(name: string): Index {
    const x = this.indexStore?.get(name);
    if (x) return x;
    const names = this.indexStore?.names() ?? [];
    throw new PermanentError(
      names.length
        ? `there is no index ${JSON.stringify(name)}; the indexes are ${names.join(", ")}`
        : `there is no index ${JSON.stringify(name)}: this process registers no index handlers`,
    );
  }

  /**
   * Declares a sub-handler (kopf's `register`/`@kopf.subhandler`): after this handler succeeds,
   * each declared sub-handler that has not finished in an earlier attempt runs, in order, and
   * is recorded as `<handler id>/<id>`. Declare the same ones on every call. Only change and
   * field handlers (and their sub-handlers) may declare sub-handlers.
   */
  register(id: string, fn: HandlerFn, options: SubhandlerOptions = {}): void {
    if (!this.canDeclare) throw new Error(`sub-handler ${JSON.stringify(id)} cannot be declared here`);
    if (!id) throw new Error("a sub-handler needs an id");
    if (this.declared.some((d) => d.id === id)) return;
    this.declared.push({ id, fn, options });
  }

  /** @internal the declared sub-handlers; no more can be declared after this. */
  takeSubhandlers(): DeclaredSubhandler[] {
    const out = this.declared;
    this.declared = [];
    this.canDeclare = false;
    return out;
  }

  /** @internal */
  setBody(body: JsonObject): void {
    this.bodyValue = body;
  }

  /**
   * Posts a Kubernetes Event about the object (kopf's `kopf.event`), always: of `type`
   * (`Normal`, `Warning`, or a name of 1 to 64 letters and digits), with `reason` and `message`.
   */
  event(type: string, reason: string, message: string): void {
    const level: LogLevel = type === "Normal" ? "info" : "warning";
    this.sink.local?.[level === "info" ? "info" : "warn"](message, {
      handler: this.handlerId,
      invocation: this.invocationId,
      event: type,
      reason,
    });
    this.sink.log({
      invocationId: this.invocationId,
      level,
      message,
      time: new Date(),
      event: { reason, type },
    });
  }

  /** kopf's `kopf.info`: a Normal Event. */
  info(reason: string, message: string): void {
    this.event("Normal", reason, message);
  }
  /** kopf's `kopf.warn`: a Warning Event. */
  warn(reason: string, message: string): void {
    this.event("Warning", reason, message);
  }
  /** kopf's `kopf.exception`: an Error Event. */
  exception(reason: string, message: string): void {
    this.event("Error", reason, message);
  }

  /**
   * Sends a patch now, while the handler keeps running (a daemon's progress); the controller
   * applies it at once. It does not touch {@link Context.patch}.
   */
  sendPatch(doc: JsonObject): void {
    const p = new Patch().merge(doc);
    if (!p.isEmpty()) this.sink.update(this.invocationId, p.toDocuments());
  }

  /**
   * Waits `seconds`, or until the invocation is cancelled (then it throws the cancellation).
   * Use it in daemons and long handlers instead of a bare timer.
   */
  sleep(seconds: number): Promise<void> {
    return sleep(seconds, this.signal);
  }

  private log(level: LogLevel, message: string): void {
    const local = this.sink.local;
    if (local) {
      const fn = level === "warning" ? "warn" : level;
      local[fn](message, { handler: this.handlerId, invocation: this.invocationId, object: this.objectName() });
    }
    this.sink.log({ invocationId: this.invocationId, level, message, time: new Date() });
  }

  private objectName(): string | undefined {
    if (!this.data.resource) return undefined;
    return this.namespace ? `${this.namespace}/${this.name}` : this.name;
  }

  /** @internal a sub-handler's context. */
  child(id: string, state: SubhandlerState | undefined): Context {
    const data: InvocationData = {
      ...this.data,
      handlerId: `${this.data.handlerId}/${id}`,
      attempt: (state?.retries ?? 0) + 1,
      idempotencyKey: `${this.data.idempotencyKey}/${id}`,
      lastError: state?.message ? { summary: state.message } : undefined,
      body: this.bodyValue,
      subhandlers: undefined,
    };
    const c = new Context(data, this.signal, this.sink, this.memos, this.indexStore, state?.started ?? new Date());
    c.memoValue = this.memoValue;
    c.canDeclare = true;
    c.cancelReasonValue = this.cancelReasonValue;
    return c;
  }
}

/** Waits `seconds`, rejecting with the signal's reason when it is aborted first. */
export function sleep(seconds: number, signal?: AbortSignal): Promise<void> {
  return new Promise((resolve, reject) => {
    if (signal?.aborted) {
      reject(signal.reason);
      return;
    }
    const onAbort = () => {
      timer.cancel();
      reject(signal!.reason);
    };
    const timer = longTimeout(() => {
      signal?.removeEventListener("abort", onAbort);
      resolve();
    }, seconds * 1000);
    signal?.addEventListener("abort", onAbort, { once: true });
  });
}

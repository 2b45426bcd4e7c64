// Calling handlers without a controller (kopf's testing counterpart): invoke a registered
// handler with a body and get its outcome, result, patch, sub-handlers, logs and Events.
//
//   import { TestKit } from "@capstan/sdk/testing";
//   const kit = new TestKit(registry);
//   const out = await kit.invoke("create_fn", { metadata: { name: "x" }, spec: { size: 3 } });
//   assert.equal(out.status, "success");
//
// Handlers run through the same code as under the controller; only the wire is missing.

import { Context } from "./context";
import type { InvocationData, LogOut, Sink } from "./context";
import { classify, execute } from "./engine";
import { CancelledError } from "./errors";
import type { CancelReason } from "./errors";
import { Indexes } from "./indexes";
import type { Index } from "./indexes";
import { silentLogger } from "./logger";
import type { Logger } from "./logger";
import { Memos } from "./memo";
import { longTimeout } from "./timers";
import type { Timer } from "./timers";
import { mergeInto } from "./patch";
import { getDefaultRegistry } from "./registry";
import type { Registry } from "./registry";
import type {
  AdmissionRequest,
  AdmissionVerdict,
  Credentials,
  Diff,
  DiffItem,
  EventType,
  JsonObject,
  LogLevel,
  Outcome,
  PatchDocument,
  Reason,
  ResourceRef,
  SubhandlerOutcome,
  SubhandlerState,
} from "./types";

/** kopf's diff between two essences: objects compared key by key, other values whole. */
export function diffOf(old: unknown, nw: unknown, path: string[] = []): DiffItem[] {
  const isObj = (v: unknown): v is JsonObject => typeof v === "object" && v !== null && !Array.isArray(v);
  if (isObj(old) && isObj(nw)) {
    const items: DiffItem[] = [];
    for (const key of Object.keys(old)) {
      if (!(key in nw)) items.push(["remove", [...path, key], old[key], null]);
      else items.push(...diffOf(old[key], nw[key], [...path, key]));
    }
    for (const key of Object.keys(nw)) if (!(key in old)) items.push(["add", [...path, key], null, nw[key]]);
    return items;
  }
  if (JSON.stringify(old) === JSON.stringify(nw)) return [];
  if (old === undefined || old === null) return [["add", path, null, nw]];
  if (nw === undefined || nw === null) return [["remove", path, old, null]];
  return [["change", path, old, nw]];
}

/** How to call a handler in the test kit. */
export interface InvokeOptions {
  /** The cause of a change handler (default: the handler's kind, `update` for field handlers). */
  reason?: Reason;
  old?: unknown;
  new?: unknown;
  /** The diff; computed from `old` and `new` when not given. */
  diff?: Diff;
  /** 1-based attempt (default 1). */
  attempt?: number;
  /** `param` (default: the registration's). */
  param?: unknown;
  /** An event handler's event type (undefined: the initial listing). */
  eventType?: EventType;
  /** An index invocation for an object leaving the index. */
  indexDeleted?: boolean;
  /** An admission handler's review (default: operation CREATE). */
  admission?: Partial<AdmissionRequest>;
  /** States of sub-handlers of earlier attempts. */
  subhandlers?: SubhandlerState[];
  /** The object's reference (default: from the body's metadata). */
  resource?: Partial<ResourceRef>;
  /** When the first attempt started (default: now). */
  started?: Date;
  /** When the attempt must end; the handler's signal is aborted then. */
  deadline?: Date;
  /** Aborting this signal cancels the handler, as a controller's cancel would. */
  signal?: AbortSignal;
}

/** What one invocation produced. */
export class TestResult {
  constructor(
    readonly outcome: Outcome,
    readonly patches: PatchDocument[],
    readonly subhandlerOutcomes: SubhandlerOutcome[],
    /** Every log record, Events included. */
    readonly records: LogOut[],
    /** Seconds the handler ran. */
    readonly duration: number,
  ) {}

  /** `success`, `temporary`, `permanent`, `unclassified`, `cancelled` or `skipped`. */
  get status(): Outcome["status"] {
    return this.outcome.status;
  }
  /** The result of a success (undefined when none). */
  get result(): unknown {
    return this.outcome.status === "success" ? this.outcome.result : undefined;
  }
  /** The error message of a failure. */
  get message(): string | undefined {
    return "message" in this.outcome ? this.outcome.message : undefined;
  }
  /** The delay of a temporary error, in seconds. */
  get delay(): number | undefined {
    return this.outcome.status === "temporary" ? this.outcome.delay : undefined;
  }
  /** An admission handler's verdict. */
  get verdict(): AdmissionVerdict | undefined {
    return this.outcome.status === "success" ? this.outcome.admission : undefined;
  }
  /** A login handler's credentials. */
  get credentials(): Credentials | undefined {
    return this.outcome.status === "success" ? this.outcome.credentials : undefined;
  }
  /** All patches merged into one document relative to the whole object (status included). */
  get patch(): JsonObject {
    const doc: JsonObject = {};
    for (const p of this.patches) if (p.type === "merge") mergeInto(doc, p.body as JsonObject);
    return doc;
  }
  /** The sub-handlers' outcomes by id. */
  get subhandlers(): Record<string, SubhandlerOutcome["outcome"]> {
    return Object.fromEntries(this.subhandlerOutcomes.map((s) => [s.id, s.outcome]));
  }
  /** The log lines, as `[level, message]` (Events left out). */
  get logs(): [LogLevel, string][] {
    return this.records.filter((r) => !r.event).map((r) => [r.level, r.message]);
  }
  /** The Events posted. */
  get events(): { type: string; reason: string; message: string }[] {
    return this.records.filter((r) => r.event).map((r) => ({ type: r.event!.type, reason: r.event!.reason, message: r.message }));
  }
}

let counter = 0;

/** Calls the handlers of a registry as the controller would, without one. */
export class TestKit {
  readonly memos: Memos;
  readonly indexes: Indexes;
  readonly updates: { invocationId: string; patches: PatchDocument[] }[] = [];

  constructor(
    readonly registry: Registry = getDefaultRegistry(),
    readonly logger: Logger = silentLogger,
  ) {
    this.memos = new Memos(registry.memo);
    this.indexes = new Indexes(registry.handlers.filter((h) => h.kind === "index").map((h) => h.id));
  }

  /** The index built by the index handler `name`. */
  index(name: string): Index {
    const x = this.indexes.get(name);
    if (!x) throw new Error(`no index handler ${JSON.stringify(name)}`);
    return x;
  }

  private data(handlerId: string, body: JsonObject | undefined, o: InvokeOptions): InvocationData {
    const spec = this.registry.get(handlerId);
    if (!spec) throw new Error(`no handler ${JSON.stringify(handlerId)} is registered`);
    const meta = (body?.metadata ?? {}) as JsonObject;
    const str = (v: unknown) => (typeof v === "string" ? v : "");
    const data: InvocationData = {
      invocationId: `test-${++counter}`,
      handlerId,
      kind: spec.kind,
      attempt: o.attempt ?? 1,
      idempotencyKey: `test-${handlerId}-${str(meta.uid)}`,
      started: o.started ?? new Date(),
      deadline: o.deadline,
      param: o.param !== undefined ? o.param : spec.options.param,
      subhandlers: o.subhandlers ?? [],
    };
    if (spec.resource) {
      const [group, version] = str(body?.apiVersion).includes("/") ? str(body?.apiVersion).split("/") : ["", str(body?.apiVersion)];
      data.resource = {
        group: group ?? "",
        version: version ?? "",
        kind: str(body?.kind),
        plural: spec.resource.name,
        namespace: str(meta.namespace),
        name: str(meta.name),
        uid: str(meta.uid),
        resourceVersion: str(meta.resourceVersion),
        generation: typeof meta.generation === "number" ? meta.generation : 0,
        ...o.resource,
      };
      data.body = body ?? {};
    }
    switch (spec.kind) {
      case "create":
      case "update":
      case "delete":
      case "resume":
      case "field": {
        data.reason = o.reason ?? (spec.kind === "field" ? "update" : spec.kind);
        let old = o.old ?? null;
        let nw = o.new ?? null;
        if (spec.kind === "field" && spec.options.field && o.old === undefined && o.new === undefined) {
          nw = fieldOf(body, spec.options.field) ?? null;
        }
        if (spec.kind === "field") data.field = spec.options.field;
        if (spec.kind === "create" && o.new === undefined && body) nw = essence(body);
        data.old = old;
        data.new = nw;
        data.diff = o.diff ?? diffOf(old, nw);
        break;
      }
      case "event":
        data.eventType = o.eventType;
        break;
      case "index":
        data.indexDeleted = o.indexDeleted ?? false;
        break;
      case "validate":
      case "mutate":
        data.admission = {
          uid: "test-review",
          operation: "CREATE",
          subresource: "",
          dryRun: false,
          oldObject: null,
          userInfo: null,
          headers: {},
          ...o.admission,
        };
        break;
      case "startup":
      case "cleanup":
      case "login":
        data.activity = spec.kind;
        break;
      default:
    }
    return data;
  }

  /** Calls the handler `handlerId` with `body` and returns what it produced. */
  async invoke(handlerId: string, body?: JsonObject, options: InvokeOptions = {}): Promise<TestResult> {
    const run = this.start(handlerId, body, options);
    return run.result;
  }

  /**
   * Starts the handler (a daemon, typically) and returns a handle to update its body, cancel it
   * and get its result.
   */
  start(handlerId: string, body?: JsonObject, options: InvokeOptions = {}): RunningHandler {
    const spec = this.registry.get(handlerId)!;
    const data = this.data(handlerId, body, options);
    const abort = new AbortController();
    const records: LogOut[] = [];
    const sink: Sink = {
      log: (r) => records.push(r),
      update: (invocationId, patches) => this.updates.push({ invocationId, patches }),
      local: this.logger,
    };
    const ctx = new Context(data, abort.signal, sink, this.memos, this.indexes);
    const cancel = (reason: CancelReason) => {
      if (abort.signal.aborted) return;
      ctx.cancelReasonValue = reason;
      abort.abort(new CancelledError(reason));
    };
    const onAbort = () => cancel("unspecified");
    options.signal?.addEventListener("abort", onAbort, { once: true });
    let timer: Timer | undefined;
    if (data.deadline) timer = longTimeout(() => cancel("deadline_exceeded"), Math.max(data.deadline.getTime() - Date.now(), 0));
    const begin = performance.now();
    // As under the controller: an error of the engine itself is the handler's unclassified error.
    const result = execute(spec, ctx, this.indexes)
      .catch((error: unknown) => ({ outcome: classify(error, ctx.signal), patches: [], subhandlers: [] }) as Awaited<ReturnType<typeof execute>>)
      .then((out) => new TestResult(out.outcome, out.patches, out.subhandlers, records, (performance.now() - begin) / 1000))
      .finally(() => {
        timer?.cancel();
        options.signal?.removeEventListener("abort", onAbort);
      });
    return {
      context: ctx,
      result,
      update: (b: JsonObject) => ctx.setBody(b),
      cancel: (reason: CancelReason = "resource_deleted") => {
        cancel(reason);
        return result;
      },
    };
  }
}

/** A handler started with {@link TestKit.start}. */
export interface RunningHandler {
  /** The handler's context. */
  context: Context;
  /** Its result, once it ends. */
  result: Promise<TestResult>;
  /** Shows the running handler a new body (the controller's object updates). */
  update(body: JsonObject): void;
  /** Cancels it (the controller's cancel) and returns its result. */
  cancel(reason?: CancelReason): Promise<TestResult>;
}

function fieldOf(body: unknown, path: string): unknown {
  let node: unknown = body;
  for (const key of path.split(".")) {
    if (!node || typeof node !== "object") return undefined;
    node = (node as JsonObject)[key];
  }
  return node;
}

/** kopf's essence of a body: what a diff looks at (labels, annotations, spec, and other top-level fields). */
function essence(body: JsonObject): JsonObject {
  const out: JsonObject = {};
  const meta = (body.metadata ?? {}) as JsonObject;
  const m: JsonObject = {};
  if (meta.labels) m.labels = meta.labels;
  if (meta.annotations) m.annotations = meta.annotations;
  if (Object.keys(m).length) out.metadata = m;
  for (const [k, v] of Object.entries(body)) {
    if (["apiVersion", "kind", "metadata", "status"].includes(k)) continue;
    out[k] = v;
  }
  return out;
}

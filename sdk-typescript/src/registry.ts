// Registering handlers with kopf's vocabulary: on.create, on.update, …, daemon, timer, index.

import type { Context } from "./context";
import { SetupError } from "./errors";
import type { Memo } from "./memo";
import type { ErrorsMode, Kind, MetaFilter, Operation, ResourceSpec, ValueFilter } from "./types";

/** A handler: called with the invocation's {@link Context}; its return value is its result. */
export type HandlerFn = (ctx: Context) => unknown;

/** An SDK-side filter (kopf's `when=`): the handler runs only when it returns true. */
export type WhenFn = (ctx: Context) => boolean;

/** Options of every handler. Durations are in seconds, as in kopf. */
export interface BaseOptions {
  /** The handler id; by default the function's name. */
  id?: string;
  /** How many attempts before giving up (kopf's `retries`). */
  retries?: number;
  /** Seconds between attempts after an error without a delay (kopf's `backoff`; 60 unless set). */
  backoff?: number;
  /** Seconds after the first attempt after which the handler fails (kopf's `timeout`). */
  timeout?: number;
  /** A JSON value given to the handler as `ctx.param` (kopf's `param`). */
  param?: unknown;
  /** What an error of no kopf class means (kopf's `errors`). */
  errors?: ErrorsMode;
  /** At most this many invocations of this handler at once (0: no own cap). */
  maxInFlight?: number;
}

/** Filters of resource handlers, evaluated by the controller (and `when` by the SDK). */
export interface FilterOptions {
  /** Label filters: a value, or `PRESENT`/`ABSENT` (kopf's `labels=`). */
  labels?: Record<string, MetaFilter>;
  /** Annotation filters (kopf's `annotations=`). */
  annotations?: Record<string, MetaFilter>;
  /** A dotted field path the filters `value`, `old`, `new` look at (kopf's `field=`). */
  field?: string;
  /** The field's value must be this JSON value (or `PRESENT`/`ABSENT`). */
  value?: ValueFilter;
  /** The field's old value (update and field handlers). */
  old?: ValueFilter;
  /** The field's new value (update and field handlers). */
  new?: ValueFilter;
  /** A callable filter, evaluated in this process before the handler runs (kopf's `when=`). */
  when?: WhenFn;
}

export type ResourceOptions = BaseOptions & FilterOptions;

/** Options of delete handlers. */
export interface DeleteOptions extends ResourceOptions {
  /** kopf's `optional`: no finalizer is added for this handler. */
  optional?: boolean;
}

/** Options of resume handlers. */
export interface ResumeOptions extends ResourceOptions {
  /** kopf's `deleted`: also resume objects being deleted. */
  deleted?: boolean;
}

/** Options of daemons (kopf's `@kopf.daemon`). */
export interface DaemonOptions extends ResourceOptions {
  initialDelay?: number;
  cancellationBackoff?: number;
  cancellationTimeout?: number;
  /** Seconds before a daemon that ended is started again. */
  restartBackoff?: number;
  /** A daemon that succeeded is not restarted. */
  noRestartAfterSuccess?: boolean;
}

/** Options of timers (kopf's `@kopf.timer`). */
export interface TimerOptions extends ResourceOptions {
  /** Seconds between ticks (required). */
  interval: number;
  initialDelay?: number;
  /** Seconds the object must be unchanged before ticks start. */
  idle?: number;
  /** Ticks at fixed times rather than `interval` after the last one ended. */
  sharp?: boolean;
}

/** Options of validating and mutating handlers. */
export interface AdmissionOptions extends ResourceOptions {
  operations?: Operation[];
  subresource?: string;
  sideEffects?: boolean;
  ignoreFailures?: boolean;
}

/** Options of activities (startup, cleanup, login) and probes. */
export type ActivityOptions = BaseOptions;

/** Options of sub-handlers. */
export interface SubhandlerOptions {
  retries?: number;
  backoff?: number;
  timeout?: number;
  errors?: ErrorsMode;
  when?: WhenFn;
}

/** A normalised resource selector. */
export interface Selector {
  group: string;
  version: string;
  name: string;
  labelSelector: string;
  fieldSelector: string;
}

/** A registered handler. */
export interface HandlerSpec {
  id: string;
  kind: Kind;
  fn: HandlerFn;
  resource?: Selector;
  options: ResourceOptions &
    Partial<Omit<DaemonOptions, keyof ResourceOptions>> &
    Partial<Omit<TimerOptions, keyof ResourceOptions>> &
    Partial<Omit<AdmissionOptions, keyof ResourceOptions>> & { optional?: boolean; deleted?: boolean };
}

export const ACTIVITY_KINDS: ReadonlySet<Kind> = new Set(["startup", "cleanup", "login", "probe"]);

function selector(resource: ResourceSpec): Selector {
  if (typeof resource === "string") {
    if (!resource) throw new Error("capstan: a resource needs a name");
    return { group: "", version: "", name: resource, labelSelector: "", fieldSelector: "" };
  }
  const name = resource.plural ?? resource.name ?? "";
  if (!name) throw new Error("capstan: a resource needs a plural or a name");
  return {
    group: resource.group ?? "",
    version: resource.version ?? "",
    name,
    labelSelector: resource.labelSelector ?? "",
    fieldSelector: resource.fieldSelector ?? "",
  };
}

function checkDuration(what: string, v: number | undefined): void {
  if (v === undefined) return;
  if (typeof v !== "number" || !Number.isFinite(v) || v < 0 || v > 365 * 24 * 3600) {
    throw new Error(`capstan: ${what} must be a number of seconds between 0 and 365 days, not ${String(v)}`);
  }
}

/** The most handlers one process may register (the protocol's limit). */
export const MAX_HANDLERS = 1000;

/** The change handlers whose id gets `/<field>` when given a field, as kopf names them. */
const FIELD_SUFFIXED_KINDS = new Set<Kind>(["create", "update", "delete", "resume"]);

/** Throws a {@link SetupError} unless `v` is unset or an integer within 0..2^32-1. */
export function checkUint32(name: string, v: number | undefined): void {
  if (v === undefined) return;
  if (typeof v !== "number" || !Number.isInteger(v) || v < 0 || v > 2 ** 32 - 1) {
    throw new SetupError(`capstan: ${name} must be an integer within 0..${2 ** 32 - 1}, not ${String(v)}`);
  }
}

/** The handlers of one operator, and kopf's registering functions bound to them. */
export class Registry {
  readonly handlers: HandlerSpec[] = [];
  /** The operator-wide memo (kopf's `memo=` of `kopf.run`); object memos start as copies of it. */
  memo: Memo = {};

  /** Registers a handler; returns `fn` (so `const f = on.create(…, async (ctx) => …)` works). */
  add(kind: Kind, resource: ResourceSpec | undefined, fn: HandlerFn, options: HandlerSpec["options"] = {}): HandlerFn {
    if (typeof fn !== "function") throw new TypeError(`capstan: a ${kind} handler must be a function`);
    let id = options.id ?? fn.name;
    if (!id) throw new Error(`capstan: a ${kind} handler needs an id (options.id) or a named function`);
    if (kind === "field") {
      if (!options.field) throw new Error("capstan: a field handler needs a field");
      id = `${id}/${options.field}`; // kopf's naming
    } else if (options.field && FIELD_SUFFIXED_KINDS.has(kind)) {
      id = `${id}/${options.field}`; // kopf names any change handler given a field so
    }
    if (this.handlers.length >= MAX_HANDLERS) throw new SetupError(`capstan: at most ${MAX_HANDLERS} handlers can be registered`);
    checkUint32("retries", options.retries);
    checkUint32("maxInFlight", options.maxInFlight);
    if (this.handlers.some((h) => h.id === id)) throw new Error(`capstan: duplicate handler id ${JSON.stringify(id)}`);
    for (const key of ["backoff", "timeout", "initialDelay", "cancellationBackoff", "cancellationTimeout", "restartBackoff", "interval", "idle"] as const) {
      checkDuration(key, options[key]);
    }
    if (kind === "timer" && !(options.interval && options.interval > 0)) {
      throw new Error("capstan: a timer needs a positive interval");
    }
    const spec: HandlerSpec = { id, kind, fn, options: { ...options } };
    if (!ACTIVITY_KINDS.has(kind)) {
      if (resource === undefined) throw new Error(`capstan: a ${kind} handler needs a resource`);
      spec.resource = selector(resource);
    }
    this.handlers.push(spec);
    return fn;
  }

  /** The handler with this id. */
  get(id: string): HandlerSpec | undefined {
    return this.handlers.find((h) => h.id === id);
  }

  /** kopf's `kopf.on.*` bound to this registry. */
  readonly on = {
    /** kopf's `@kopf.on.create`. */
    create: (resource: ResourceSpec, fn: HandlerFn, options?: ResourceOptions) => this.add("create", resource, fn, options),
    /** kopf's `@kopf.on.update`. */
    update: (resource: ResourceSpec, fn: HandlerFn, options?: ResourceOptions) => this.add("update", resource, fn, options),
    /** kopf's `@kopf.on.delete`. */
    delete: (resource: ResourceSpec, fn: HandlerFn, options?: DeleteOptions) => this.add("delete", resource, fn, options),
    /** kopf's `@kopf.on.resume`. */
    resume: (resource: ResourceSpec, fn: HandlerFn, options?: ResumeOptions) => this.add("resume", resource, fn, options),
    /** kopf's `@kopf.on.field`: the id is `<id>/<field>`. */
    field: (resource: ResourceSpec, field: string, fn: HandlerFn, options?: ResourceOptions) =>
      this.add("field", resource, fn, { ...options, field }),
    /** kopf's `@kopf.on.event`. */
    event: (resource: ResourceSpec, fn: HandlerFn, options?: ResourceOptions) => this.add("event", resource, fn, options),
    /** kopf's `@kopf.on.validate`. */
    validate: (resource: ResourceSpec, fn: HandlerFn, options?: AdmissionOptions) => this.add("validate", resource, fn, options),
    /** kopf's `@kopf.on.mutate`. */
    mutate: (resource: ResourceSpec, fn: HandlerFn, options?: AdmissionOptions) => this.add("mutate", resource, fn, options),
    /** kopf's `@kopf.on.startup`. */
    startup: (fn: HandlerFn, options?: ActivityOptions) => this.add("startup", undefined, fn, options),
    /** kopf's `@kopf.on.cleanup`. */
    cleanup: (fn: HandlerFn, options?: ActivityOptions) => this.add("cleanup", undefined, fn, options),
    /** kopf's `@kopf.on.login`: returns {@link Credentials}. */
    login: (fn: HandlerFn, options?: ActivityOptions) => this.add("login", undefined, fn, options),
    /** kopf's `@kopf.on.probe`. */
    probe: (fn: HandlerFn, options?: ActivityOptions) => this.add("probe", undefined, fn, options),
  };

  /** kopf's `@kopf.daemon`. */
  daemon(resource: ResourceSpec, fn: HandlerFn, options?: DaemonOptions): HandlerFn {
    return this.add("daemon", resource, fn, options);
  }

  /** kopf's `@kopf.timer`. */
  timer(resource: ResourceSpec, fn: HandlerFn, options: TimerOptions): HandlerFn {
    return this.add("timer", resource, fn, options);
  }

  /** kopf's `@kopf.index`: the handler's id is the index's name. */
  index(resource: ResourceSpec, fn: HandlerFn, options?: ResourceOptions): HandlerFn {
    return this.add("index", resource, fn, options);
  }
}

let defaultRegistry = new Registry();

/** The registry that the module-level `on`, `daemon`, `timer` and `index` register into. */
export function getDefaultRegistry(): Registry {
  return defaultRegistry;
}

/** Replaces the default registry (tests); returns the previous one. */
export function setDefaultRegistry(registry: Registry): Registry {
  const previous = defaultRegistry;
  defaultRegistry = registry;
  return previous;
}

/** kopf's `kopf.on`, registering into the default registry. */
export const on: Registry["on"] = {
  create: (r, fn, o) => defaultRegistry.on.create(r, fn, o),
  update: (r, fn, o) => defaultRegistry.on.update(r, fn, o),
  delete: (r, fn, o) => defaultRegistry.on.delete(r, fn, o),
  resume: (r, fn, o) => defaultRegistry.on.resume(r, fn, o),
  field: (r, field, fn, o) => defaultRegistry.on.field(r, field, fn, o),
  event: (r, fn, o) => defaultRegistry.on.event(r, fn, o),
  validate: (r, fn, o) => defaultRegistry.on.validate(r, fn, o),
  mutate: (r, fn, o) => defaultRegistry.on.mutate(r, fn, o),
  startup: (fn, o) => defaultRegistry.on.startup(fn, o),
  cleanup: (fn, o) => defaultRegistry.on.cleanup(fn, o),
  login: (fn, o) => defaultRegistry.on.login(fn, o),
  probe: (fn, o) => defaultRegistry.on.probe(fn, o),
};

/** kopf's `@kopf.daemon`, in the default registry. */
export function daemon(resource: ResourceSpec, fn: HandlerFn, options?: DaemonOptions): HandlerFn {
  return defaultRegistry.daemon(resource, fn, options);
}

/** kopf's `@kopf.timer`, in the default registry. */
export function timer(resource: ResourceSpec, fn: HandlerFn, options: TimerOptions): HandlerFn {
  return defaultRegistry.timer(resource, fn, options);
}

/** kopf's `@kopf.index`, in the default registry. */
export function index(resource: ResourceSpec, fn: HandlerFn, options?: ResourceOptions): HandlerFn {
  return defaultRegistry.index(resource, fn, options);
}

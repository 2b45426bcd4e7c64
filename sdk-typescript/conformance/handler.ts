// The TypeScript SDK's conformance handler for the capstan.v1 conformance kit
// (tests/conformance/README.md): registers the kit's fixed handlers on
// widgets.v1.conformance.capstan.dev and runs, in each resource handler, the script in the
// spec.script of the body it is given.
//
// It dials $CAPSTAN_ENDPOINT, registers the handlers of the features named in
// $CAPSTAN_CONFORMANCE_FEATURES (comma-separated; unset: every feature this SDK supports), and
// runs until SIGTERM, then stops as the SDK stops. It logs to standard error only.

import { AdmissionError, PermanentError, Registry, SetupError, TemporaryError, run, setMaxInFlight, sleep } from "../src/index";
import type { Context, Credentials, HandlerFn, LogLevel } from "../src/index";

const RESOURCE = "widgets.v1.conformance.capstan.dev";

const FEATURE_HANDLERS: Record<string, string[]> = {
  change: ["create", "update", "delete", "resume"],
  field: ["field"],
  event: ["event"],
  daemon: ["daemon"],
  timer: ["timer"],
  index: ["index"],
  admission: ["validate", "mutate"],
  sdk_filters: ["when"],
  activities: ["startup", "cleanup", "login"],
  probe: ["probe"],
};
const OTHER_FEATURES = ["subhandlers", "object_updates", "result_ack", "cleanup_on_goodbye", "tcp", "flow_control", "message_limit", "invocation_updates", "attempt_details"];

const CHANGE_KINDS = new Set(["create", "update", "delete", "resume", "field"]);
const ADMISSION_KINDS = new Set(["validate", "mutate"]);
const LEVELS = new Set(["debug", "info", "warning", "error"]);

/** Ends the script in success with a result. */
class Ended {
  constructor(readonly result: unknown) {}
}

function text(v: unknown): string {
  if (typeof v === "string") return v;
  if (v === undefined || v === null) return "";
  return JSON.stringify(v);
}

function seconds(v: unknown): number {
  if (typeof v !== "number" || !Number.isFinite(v) || v < 0) throw new Error(`conformance: ${text(v)} is not a number of seconds`);
  return v;
}

function fields(arg: unknown): Record<string, unknown> {
  return arg && typeof arg === "object" && !Array.isArray(arg) ? (arg as Record<string, unknown>) : {};
}

/** The echo of what the handler was given; what it was not given is null. */
function echo(ctx: Context): unknown {
  const meta = ctx.meta;
  const change = CHANGE_KINDS.has(ctx.kind);
  const admission = ADMISSION_KINDS.has(ctx.kind);
  const labels = meta.labels && typeof meta.labels === "object" ? meta.labels : {};
  return {
    name: ctx.name ?? null,
    namespace: ctx.namespace ?? null,
    uid: ctx.uid ?? null,
    spec: ctx.body.spec ?? null,
    labels,
    retry: ctx.retry,
    param: ctx.param,
    reason: change ? (ctx.reason ?? null) : null,
    old: change ? ctx.old : null,
    new: change ? ctx.new : null,
    diff: change ? ctx.diff.map(([op, path, old, nw]) => [op, [...path], old ?? null, nw ?? null]) : null,
    event_type: ctx.kind === "event" ? (ctx.type ?? null) : null,
    operation: admission ? (ctx.operation ?? null) : null,
    dry_run: admission ? (ctx.dryRun ?? null) : null,
    subresource: admission ? (ctx.subresource ?? null) : null,
    idempotency_key: ctx.idempotencyKey || null,
    traceparent: ctx.traceparent ?? null,
    last_error: ctx.lastError?.summary ?? null,
  };
}

/** Waits until the signal is aborted, then throws its reason. */
function hang(signal: AbortSignal): Promise<never> {
  return new Promise((_, reject) => {
    if (signal.aborted) reject(signal.reason);
    else signal.addEventListener("abort", () => reject(signal.reason), { once: true });
  });
}

async function action(ctx: Context, name: string, arg: unknown): Promise<void> {
  const f = fields(arg);
  switch (name) {
    case "log": {
      const level = (LEVELS.has(text(f.level)) ? text(f.level) : "info") as LogLevel;
      ctx.logger.log(level, text(f.message));
      return;
    }
    case "event":
      ctx.event(text(f.type) || "Normal", text(f.reason), text(f.message));
      return;
    case "patch":
      if (!arg || typeof arg !== "object" || Array.isArray(arg)) throw new Error(`conformance: patch needs an object, not ${text(arg)}`);
      ctx.patch.merge(arg as Record<string, unknown>);
      return;
    case "send_patch":
      if (!arg || typeof arg !== "object" || Array.isArray(arg)) throw new Error(`conformance: send_patch needs an object, not ${text(arg)}`);
      ctx.sendPatch(arg as Record<string, unknown>);
      return;
    case "return":
      throw new Ended(arg);
    case "echo":
      throw new Ended(echo(ctx));
    case "temporary":
      throw new TemporaryError(text(f.message), f.delay === undefined || f.delay === null ? {} : { delay: seconds(f.delay) });
    case "permanent":
      throw new PermanentError(text(f.message));
    case "crash":
      throw new Error(text(f.message));
    case "sleep":
      await sleep(seconds(arg), ctx.signal);
      return;
    case "hang":
      await hang(ctx.signal);
      return;
    case "hang_ignoring_cancel":
      await sleep(seconds(arg));
      throw new Ended({ ignored_cancel: true });
    case "subhandlers": {
      if (!Array.isArray(arg)) throw new Error(`conformance: subhandlers needs a list, not ${text(arg)}`);
      for (const item of arg) {
        const sub = fields(item);
        const id = typeof sub.id === "string" ? sub.id : "";
        const script = sub.script ?? [];
        if (!id || !Array.isArray(script)) throw new Error(`conformance: a sub-handler needs an id and a script: ${text(item)}`);
        ctx.register(id, (child) => runScript(child, script));
      }
      return;
    }
    case "deny":
      throw new AdmissionError(text(f.message), f.code === undefined || f.code === null ? undefined : Number(f.code));
    case "warn":
      ctx.warnings.push(text(arg));
      return;
    case "flow": {
      const n = Number(f.max_in_flight ?? 0);
      setMaxInFlight(typeof f.handler === "string" && f.handler ? f.handler : undefined, n);
      return;
    }
    default:
      throw new Error(`conformance: unknown action ${JSON.stringify(name)}`);
  }
}

async function runScript(ctx: Context, script: unknown): Promise<unknown> {
  if (script === undefined || script === null) return null;
  if (!Array.isArray(script)) throw new Error(`conformance: a script must be a list of actions, not ${text(script)}`);
  try {
    for (const item of script) {
      const a = fields(item);
      const keys = Object.keys(a);
      if (keys.length !== 1) throw new Error(`conformance: an action must be an object with one key: ${text(item)}`);
      await action(ctx, keys[0]!, a[keys[0]!]);
    }
  } catch (e) {
    if (e instanceof Ended) return e.result;
    throw e;
  }
  return null;
}

/** Every resource handler: runs the script of the body it is given (read once, at the start). */
const scripted: HandlerFn = (ctx) => runScript(ctx, ctx.spec.script);

function register(reg: Registry, id: string): void {
  switch (id) {
    case "create":
      reg.on.create(RESOURCE, scripted, { id: "create", param: { p: 1 } });
      break;
    case "update":
      reg.on.update(RESOURCE, scripted, { id: "update", retries: 3, backoff: 2, timeout: 30 });
      break;
    case "delete":
      reg.on.delete(RESOURCE, scripted, { id: "delete" });
      break;
    case "resume":
      reg.on.resume(RESOURCE, scripted, { id: "resume" });
      break;
    case "field":
      reg.on.field(RESOURCE, "spec.watched", scripted, { id: "field" }); // kopf's id: field/spec.watched
      break;
    case "event":
      reg.on.event(RESOURCE, scripted, { id: "event" });
      break;
    case "daemon":
      reg.daemon(RESOURCE, scripted, { id: "daemon" });
      break;
    case "timer":
      reg.timer(RESOURCE, scripted, { id: "timer", interval: 3600 });
      break;
    case "index":
      reg.index(RESOURCE, scripted, { id: "index" });
      break;
    case "validate":
      reg.on.validate(RESOURCE, scripted, { id: "validate" });
      break;
    case "mutate":
      reg.on.mutate(RESOURCE, scripted, { id: "mutate" });
      break;
    case "when":
      reg.on.create(RESOURCE, scripted, { id: "when", when: (ctx) => ctx.spec.allowed === true });
      break;
    case "startup":
      reg.on.startup(
        (ctx) => {
          if (ctx.retry === 0) throw new TemporaryError("not yet", { delay: 0.25 });
          ctx.logger.info("startup");
        },
        { id: "startup" },
      );
      break;
    case "cleanup":
      reg.on.cleanup((ctx) => ctx.logger.info("cleanup"), { id: "cleanup" });
      break;
    case "login":
      reg.on.login(
        (): Credentials => ({ server: "https://conformance.invalid:6443", token: "conformance-token", defaultNamespace: "conformance" }),
        { id: "login" },
      );
      break;
    case "probe":
      reg.on.probe(() => ({ probe: "ok" }), { id: "probe" });
      break;
    default:
      throw new Error(id);
  }
}

function features(): string[] {
  const value = process.env.CAPSTAN_CONFORMANCE_FEATURES;
  if (value === undefined) return [...Object.keys(FEATURE_HANDLERS), ...OTHER_FEATURES];
  const names = value
    .split(",")
    .map((s) => s.trim())
    .filter(Boolean);
  for (const name of names) {
    if (!(name in FEATURE_HANDLERS) && !OTHER_FEATURES.includes(name)) process.stderr.write(`conformance: unknown feature ${name}; ignored\n`);
  }
  return names;
}

async function main(): Promise<void> {
  const reg = new Registry();
  const wanted = features();
  for (const [feature, ids] of Object.entries(FEATURE_HANDLERS)) {
    if (wanted.includes(feature)) for (const id of ids) register(reg, id);
  }
  process.stderr.write(`conformance: features ${wanted.join(",")}: handlers ${reg.handlers.map((h) => h.id).join(",")}\n`);
  try {
    await run({ registry: reg });
  } catch (error) {
    process.stderr.write(`conformance: ${error instanceof SetupError ? error.message : String((error as Error)?.stack ?? error)}\n`);
    process.exit(1);
  }
  process.stderr.write("conformance: stopped\n");
  process.exit(0);
}

void main();

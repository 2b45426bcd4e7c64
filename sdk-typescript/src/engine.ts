// Runs one invocation, from its Context to its outcome: the `when` filter, the handler, the
// sub-handlers it declared, and the classification of errors as kopf classifies them. Nothing
// here knows the wire; the session and the test kit both use it.

import { AdmissionError, CancelledError, PermanentError, TemporaryError } from "./errors";
import type { Context } from "./context";
import type { Indexes } from "./indexes";
import type { HandlerFn, HandlerSpec, SubhandlerOptions } from "./registry";
import type {
  AdmissionVerdict,
  Credentials,
  Diagnostic,
  InvocationOutcome,
  Outcome,
  PatchDocument,
  SubhandlerOutcome,
  SubhandlerState,
} from "./types";

const ADMISSION = new Set(["validate", "mutate"]);

type Called = { ok: true; value: unknown } | { ok: false; error: unknown };

async function call(fn: HandlerFn, ctx: Context): Promise<Called> {
  try {
    return { ok: true, value: await fn(ctx) };
  } catch (error) {
    return { ok: false, error };
  }
}

function describe(error: unknown): { message: string; diagnostic: Diagnostic; stack?: string } {
  const err = error instanceof Error ? error : undefined;
  const text = err ? err.message : typeof error === "string" ? error : safeString(error);
  const nl = text.indexOf("\n");
  const summary = nl >= 0 ? text.slice(0, nl) : text;
  const detail = nl >= 0 ? text.slice(nl + 1) : undefined;
  const errorType = err ? err.name || err.constructor?.name || "Error" : typeof error;
  return { message: text, diagnostic: { summary: summary || errorType, detail, errorType }, stack: err?.stack };
}

function safeString(v: unknown): string {
  try {
    return JSON.stringify(v) ?? String(v);
  } catch {
    return String(v);
  }
}

/** Classifies a handler's error as kopf does; a cancelled invocation's error is `cancelled`. */
export function classify(error: unknown, signal?: AbortSignal): Outcome {
  if (signal?.aborted || error instanceof CancelledError) return { status: "cancelled" };
  const d = describe(error);
  if (error instanceof TemporaryError) {
    return { status: "temporary", message: d.message, delay: error.delay, diagnostic: { ...d.diagnostic, reason: "TEMPORARY_ERROR" } };
  }
  if (error instanceof PermanentError) {
    return { status: "permanent", message: d.message, diagnostic: { ...d.diagnostic, reason: "PERMANENT_ERROR" } };
  }
  return { status: "unclassified", message: d.message, diagnostic: { ...d.diagnostic, reason: "HANDLER_ERROR" }, stack: d.stack };
}

/** A success with the handler's value: credentials for login handlers, JSON for the rest. */
function success(spec: { kind: string }, value: unknown): Outcome {
  if (spec.kind === "login") {
    if (value && typeof value === "object") return { status: "success", credentials: value as Credentials };
    return { status: "success" };
  }
  if (value === undefined || value === null) return { status: "success" };
  let text: string | undefined;
  try {
    text = JSON.stringify(value);
  } catch (error) {
    throw new PermanentError(`the handler returned a value that is not JSON-serialisable: ${describe(error).message}`);
  }
  if (text === undefined || text === "null") return { status: "success" };
  return { status: "success", result: JSON.parse(text) };
}

function objectKey(ctx: Context) {
  const r = ctx.resource;
  return { namespace: r?.namespace ?? "", name: r?.name ?? "", uid: r?.uid ?? "" };
}

/** Runs a handler for its context; returns its outcome, patches and sub-handler outcomes. */
export async function execute(spec: HandlerSpec, ctx: Context, indexes?: Indexes): Promise<Omit<InvocationOutcome, "duration">> {
  const none = { patches: [] as PatchDocument[], subhandlers: [] as SubhandlerOutcome[] };
  const index = spec.kind === "index" ? indexes?.get(spec.id) : undefined;
  if (spec.kind === "index" && ctx.data.indexDeleted) {
    index?.drop(objectKey(ctx)); // the object left the index; the handler is not called (kopf)
    return { outcome: { status: "success" }, ...none };
  }
  if (spec.options.when) {
    let pass: boolean;
    try {
      pass = Boolean(spec.options.when(ctx));
    } catch (error) {
      return { outcome: classify(error, ctx.signal), ...none };
    }
    if (!pass) {
      index?.drop(objectKey(ctx)); // kopf: an object the filters reject is not in the index
      return { outcome: { status: "skipped" }, ...none };
    }
  }
  const called = await call(spec.fn, ctx);

  if (index) {
    if (called.ok) {
      try {
        index.fold(objectKey(ctx), success(spec, called.value).status === "success" ? called.value : undefined);
      } catch {
        index.drop(objectKey(ctx));
      }
    } else {
      const o = classify(called.error, ctx.signal);
      const keep = o.status === "cancelled" || (o.status === "unclassified" && (!spec.options.errors || spec.options.errors === "ignored"));
      if (!keep) index.drop(objectKey(ctx));
    }
  }

  if (ADMISSION.has(spec.kind)) {
    let verdict: AdmissionVerdict | undefined;
    if (called.ok) verdict = { allowed: true, warnings: [...ctx.warnings] };
    else if (called.error instanceof AdmissionError && !ctx.signal.aborted) {
      verdict = { allowed: false, message: called.error.message, code: called.error.code, warnings: [...ctx.warnings] };
    }
    if (verdict) {
      const patches = verdict.allowed && spec.kind === "mutate" ? ctx.patch.toDocuments(false) : [];
      return { outcome: { status: "success", admission: verdict }, patches, subhandlers: [] };
    }
  }

  if (!called.ok) return { outcome: classify(called.error, ctx.signal), ...none };
  let outcome: Outcome;
  try {
    outcome = success(spec, called.value);
  } catch (error) {
    return { outcome: classify(error), ...none };
  }
  const patches = ctx.patch.toDocuments();
  const states = new Map<string, SubhandlerState>();
  for (const st of ctx.data.subhandlers ?? []) states.set(st.id, st);
  const subs = await runSubhandlers(ctx, "", states);
  if ((subs.ran || subs.cut) && ctx.signal.aborted) {
    // Cancelled while its sub-handlers ran, or before they could: the parent is not finished;
    // they run on its next call. (The signal is looked at last: it is made on first use.)
    return { outcome: { status: "cancelled" }, ...none };
  }
  return { outcome, patches: [...patches, ...subs.patches], subhandlers: subs.outcomes };
}

interface SubRun {
  outcomes: SubhandlerOutcome[];
  patches: PatchDocument[];
  finished: boolean;
  ran: boolean;
  /** A sub-handler that was neither finished nor waiting was left unrun or cut short by a cancel. */
  cut: boolean;
}

/**
 * Runs the sub-handlers `parent` declared that are neither finished nor waiting, in order. A
 * sub-handler that declared sub-handlers of its own is reported once those are finished.
 */
async function runSubhandlers(parent: Context, prefix: string, states: Map<string, SubhandlerState>): Promise<SubRun> {
  const out: SubRun = { outcomes: [], patches: [], finished: true, ran: false, cut: false };
  for (const sub of parent.takeSubhandlers()) {
    const id = prefix + sub.id;
    const st = states.get(id);
    if (st?.success || st?.failure) continue;
    if (st?.delayedUntil && st.delayedUntil.getTime() > Date.now()) {
      out.finished = false;
      continue;
    }
    if (parent.signal.aborted) {
      out.finished = false;
      out.cut = true;
      return out;
    }
    const child = parent.child(sub.id, st);
    if (sub.options.when) {
      let pass = false;
      try {
        pass = Boolean(sub.options.when(child));
      } catch {
        pass = false;
      }
      if (!pass) continue;
    }
    out.ran = true;
    let failure: Outcome;
    if (sub.options.timeout !== undefined && sub.options.timeout > 0 && child.runtime > sub.options.timeout) {
      failure = classify(new PermanentError(`timed out after ${sub.options.timeout}s`));
    } else {
      const called = await call(sub.fn, child);
      if (called.ok) {
        let ok: Outcome | undefined;
        try {
          ok = success({ kind: "create" }, called.value);
        } catch (error) {
          failure = classify(error);
        }
        if (ok) {
          const own = child.patch.toDocuments();
          const nested = await runSubhandlers(child, id + "/", states);
          out.outcomes.push(...nested.outcomes);
          out.patches.push(...own, ...nested.patches);
          if (nested.cut) out.cut = true;
          if (!nested.finished) {
            out.finished = false;
            continue;
          }
          out.outcomes.push({ id, outcome: ok });
          continue;
        }
      } else {
        failure = classify(called.error, child.signal);
      }
    }
    if (parent.signal.aborted) {
      out.finished = false;
      out.cut = true;
      return out;
    }
    const judged = judge(sub.options, failure!, st?.retries ?? 0);
    if (judged.status === "temporary" || judged.status === "unclassified") out.finished = false;
    out.outcomes.push({ id, outcome: judged });
  }
  return out;
}

/**
 * Applies a sub-handler's own options to its failure: its errors mode and backoff to an
 * unclassified error, and its retry limit to a retryable one.
 */
function judge(options: SubhandlerOptions, failure: Outcome, retries: number): Outcome {
  if (failure.status === "temporary" && failure.delay === undefined && options.backoff !== undefined) {
    failure = { ...failure, delay: options.backoff }; // a TemporaryError without a delay waits the backoff
  }
  if (failure.status === "unclassified") {
    switch (options.errors) {
      case "ignored":
        return { status: "success" };
      case "permanent":
        failure = { status: "permanent", message: failure.message, diagnostic: failure.diagnostic };
        break;
      case "temporary":
        failure = { status: "temporary", message: failure.message, diagnostic: failure.diagnostic, delay: options.backoff };
        break;
      default:
        if (options.backoff !== undefined && options.backoff > 0) {
          failure = { status: "temporary", message: failure.message, diagnostic: failure.diagnostic, delay: options.backoff };
        }
    }
  }
  if (options.retries !== undefined && options.retries > 0 && retries + 1 >= options.retries) {
    if (failure.status === "temporary" || failure.status === "unclassified") {
      const summary = `${failure.diagnostic.summary} (retries exhausted after ${retries + 1} attempts)`;
      return { status: "permanent", message: failure.message, diagnostic: { ...failure.diagnostic, summary } };
    }
  }
  return failure;
}

// The benchmark's handler process written with the TypeScript SDK (sdk-typescript, imported as
// `@capstan/sdk`), run as `node handlers.js` after tests/bench/tshandler/build.sh. Like
// bench-go-handler and pyhandler/handlers.py, BENCH_HANDLERS (comma-separated presets: create,
// create3, update, delete, results) picks the handlers it registers for the example resource,
// and every call appends "<handler id> <object name> <attempt>" to BENCH_LOG. Handlers are
// async functions on Node's event loop; the SDK's own log goes to standard error from WARN up.

import { openSync, writeSync } from "node:fs";
import { SetupError, TemporaryError, on, run, stderrLogger } from "@capstan/sdk";
import type { Context, HandlerFn } from "@capstan/sdk";

const RESOURCE = "examples.demo.capstan.dev";

const logFd = process.env.BENCH_LOG ? openSync(process.env.BENCH_LOG, "a") : undefined;

/** One line per call, written at once (the driver counts the lines while the run goes on). */
function record(handlerId: string, ctx: Context): void {
  if (logFd !== undefined) writeSync(logFd, `${handlerId} ${ctx.name ?? ""} ${ctx.retry + 1}\n`);
}

/** Fails the first spec.temporary.<id> attempts, as the Rust e2e handler does. */
function temporary(handlerId: string, ctx: Context): void {
  const t = ctx.spec.temporary;
  const limit = t && typeof t === "object" && !Array.isArray(t) ? Number((t as Record<string, unknown>)[handlerId] ?? 0) : 0;
  if (ctx.retry < limit) throw new TemporaryError(`temporary failure ${ctx.retry + 1} of ${limit}`, { delay: 1 });
}

function plain(handlerId: string): HandlerFn {
  return async (ctx) => {
    record(handlerId, ctx);
    temporary(handlerId, ctx);
  };
}

function labelled(handlerId: string, value: string): HandlerFn {
  return async (ctx) => {
    record(handlerId, ctx);
    ctx.patch.label(`e2e/${value}`, "1");
  };
}

function withResult(handlerId: string): HandlerFn {
  return async (ctx) => {
    record(handlerId, ctx);
    return { message: `hello ${ctx.name}`, attempts: ctx.retry + 1 };
  };
}

for (const raw of (process.env.BENCH_HANDLERS || "create").split(",")) {
  const preset = raw.trim();
  switch (preset) {
    case "create":
      on.create(RESOURCE, plain("create_fn"), { id: "create_fn" });
      break;
    case "create3":
      on.create(RESOURCE, labelled("create_a", "a"), { id: "create_a" });
      on.create(RESOURCE, labelled("create_b", "b"), { id: "create_b" });
      on.create(RESOURCE, plain("create_c"), { id: "create_c" });
      break;
    case "results":
      on.create(RESOURCE, withResult("create_fn"), { id: "create_fn" });
      break;
    case "update":
      on.update(RESOURCE, withResult("update_fn"), { id: "update_fn" });
      break;
    case "delete":
      on.delete(RESOURCE, plain("delete_fn"), { id: "delete_fn" });
      break;
    case "":
      break;
    default:
      process.stderr.write(`unknown preset ${JSON.stringify(preset)}\n`);
      process.exit(2);
  }
}

run({ logger: stderrLogger("warn") }).catch((error: unknown) => {
  process.stderr.write(`handler process failed: ${error instanceof SetupError ? error.message : String(error)}\n`);
  process.exit(1);
});

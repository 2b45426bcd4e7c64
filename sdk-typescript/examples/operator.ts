// The demo operator of the quick start, in TypeScript: handles `examples.demo.capstan.dev`
// objects (kind `Example`, short name `cex`) with one handler of each common kind.
//
// Run it next to a `capstan` controller: `node dist/examples/operator.js`. It dials
// $CAPSTAN_ENDPOINT (default unix:///run/capstan/capstan.sock) and stops on Ctrl-C or SIGTERM.

import { TemporaryError, daemon, on, run, timer } from "../src/index";

const RESOURCE = "examples.demo.capstan.dev";

// Greets new objects and marks them as handled.
on.create(RESOURCE, async function create_fn({ name, patch, info }) {
  patch.label("demo.capstan.dev/handled", "yes");
  info("Created", `created ${name}`);
  return { message: `hello ${name}` };
});

// Acknowledges changes of the spec.
on.update(RESOURCE, async function update_fn() {
  return { message: "updated" };
});

// Logs how spec.field changed (registered as "field_fn/spec.field").
on.field(RESOURCE, "spec.field", async function field_fn({ old, new: value, logger }) {
  logger.info(`spec.field changed: ${JSON.stringify(old)} -> ${JSON.stringify(value)}`);
});

// Logs deletions.
on.delete(RESOURCE, async function delete_fn({ name, logger }) {
  logger.info(`deleting ${name}`);
});

// Fails spec.fail_times times with a temporary error, then succeeds.
on.create(RESOURCE, async function flaky_fn({ spec, retry }) {
  const failTimes = typeof spec.fail_times === "number" ? spec.fail_times : 0;
  if (retry < failTimes) throw new TemporaryError(`failing on purpose (${retry + 1} of ${failTimes})`, { delay: 1 });
  return { attempts: retry + 1 };
});

// Logs every watch event's type.
on.event(RESOURCE, async function event_fn({ type, logger }) {
  logger.debug(`event ${type ?? "NONE"}`);
});

// Reports every few seconds that the object is monitored, until cancelled.
daemon(
  RESOURCE,
  async function monitor(ctx) {
    try {
      for (;;) {
        ctx.logger.debug(`${ctx.name} is monitored`);
        await ctx.sleep(5);
      }
    } finally {
      process.stderr.write(`monitor of ${ctx.name} stopped (${ctx.cancelReason ?? "done"})\n`);
    }
  },
  { cancellationTimeout: 10 },
);

// Counts ticks in status.ticks.
timer(
  RESOURCE,
  async function tick({ status, patch }) {
    patch.status.ticks = (typeof status.ticks === "number" ? status.ticks : 0) + 1;
  },
  { interval: 10 },
);

run().then(
  () => process.exit(0),
  (error) => {
    process.stderr.write(`operator failed: ${error instanceof Error ? error.message : String(error)}\n`);
    process.exit(1);
  },
);

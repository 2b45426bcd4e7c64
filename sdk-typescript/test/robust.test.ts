// The review's defects: a bad or oversize result, a cancel without a grace period, long timers,
// reconnect leaks, the outgoing buffer, and the checks at registration.

import { test } from "node:test";
import assert from "node:assert/strict";
import { getEventListeners } from "node:events";
import { mkdtempSync, rmSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";
import * as grpc from "@grpc/grpc-js";
import { durationFromMs } from "@bufbuild/protobuf/wkt";
import { AdmissionError, Operator, PermanentError, Registry, SetupError, TemporaryError, silentLogger } from "../src/index";
import type { Logger } from "../src/index";
import { TestKit } from "../src/testing";
import { longTimeout } from "../src/timers";
import { MAX_HANDLERS } from "../src/registry";
import { response, resultRequest } from "../src/wire";
import { CancelReason } from "../src/gen/capstan/v1/invocation_pb";
import { FakeController, invocation, json } from "./fake";

const R = "widgets.v1.example.com";
const body = { apiVersion: "example.com/v1", kind: "Widget", metadata: { name: "w", namespace: "ns", uid: "u" }, spec: {} };
const pause = (ms: number) => new Promise((r) => setTimeout(r, ms));

/** A logger that keeps the warnings. */
function recorder(): Logger & { warnings: string[] } {
  const warnings: string[] = [];
  return { warnings, debug() {}, info() {}, warn: (m) => warnings.push(m), error: (m) => warnings.push(m) };
}

async function harness(t: import("node:test").TestContext, reg: Registry, logger: Logger = silentLogger) {
  const dir = mkdtempSync(join(tmpdir(), "capstan-ts-"));
  const fake = new FakeController(join(dir, "capstan.sock"));
  await fake.start();
  const op = new Operator(reg, { endpoint: `unix://${join(dir, "capstan.sock")}`, logger, handleSignals: false, reconnectDelay: 0.05, shutdownGrace: 1 });
  const running = op.run();
  t.after(async () => {
    op.stop();
    for (const c of fake.conns) c.call.end();
    await running.catch(() => {});
    fake.stop();
    rmSync(dir, { recursive: true, force: true });
  });
  return { fake, op, running };
}

test("a result that cannot be encoded is a permanent error, and the stream goes on", async (t) => {
  const reg = new Registry();
  let release: () => void = () => {};
  const released = new Promise<void>((r) => (release = r));
  reg.on.create(R, async (ctx) => {
    if (ctx.spec.bigint) ctx.patch.status.count = 10n as unknown as number;
    if (ctx.spec.nan) throw new TemporaryError("x", { delay: NaN });
    if (ctx.spec.inf) throw new TemporaryError("x", { delay: Infinity });
    if (ctx.spec.far) throw new TemporaryError("x", { delay: 400 * 24 * 3600 });
    if (ctx.spec.wait) await released;
    return { ok: true };
  }, { id: "create" });
  const { fake } = await harness(t, reg);
  const { conn } = await fake.handshake(1);
  for (const [id, spec] of [["b", { bigint: true }], ["n", { nan: true }], ["i", { inf: true }], ["f", { far: true }]] as const) {
    conn.send(invocation(id, "create", spec));
    const r = await conn.next("result", (x) => x.invocationId === id);
    assert.equal(r.outcome.case, "permanentError", id);
    assert.equal(r.outcome.value.diagnostics[0].reason, "RESULT_NOT_ENCODABLE", id);
  }
  // The stream is still up: pings, and a good result.
  conn.send(response({ message: { case: "ping", value: { nonce: 9n } } }));
  await conn.next("pong", (p) => p.nonce === 9n);
  conn.send(invocation("ok", "create", {}));
  assert.deepEqual(json((await conn.next("result", (x) => x.invocationId === "ok")).outcome.value.result), { ok: true });
  release();
});

test("admission codes and retry delays are checked when the result is built", () => {
  const admission = (code: number) =>
    resultRequest("a", { outcome: { status: "success", admission: { allowed: false, message: "no", code, warnings: [] } }, patches: [], subhandlers: [], duration: 0 });
  assert.throws(() => admission(403.5), RangeError);
  assert.throws(() => admission(2 ** 31), RangeError);
  assert.doesNotThrow(() => admission(403));
  const temporary = (delay: number) =>
    resultRequest("t", { outcome: { status: "temporary", message: "x", delay, diagnostic: { severity: "error", summary: "x" } } as never, patches: [], subhandlers: [], duration: 0 });
  assert.throws(() => temporary(-1), RangeError);
  assert.throws(() => temporary(NaN), RangeError);
  assert.doesNotThrow(() => temporary(365 * 24 * 3600));
});

test("an oversize result is a permanent error; an oversize log record is dropped", async (t) => {
  const reg = new Registry();
  const big = "x".repeat(17 * 1024 * 1024);
  reg.on.create(R, (ctx) => {
    if (ctx.spec.log) {
      ctx.logger.info(big);
      return { small: true };
    }
    return { big };
  }, { id: "create" });
  const { fake } = await harness(t, reg);
  const { conn } = await fake.handshake(1);
  conn.send(invocation("big", "create", {}));
  const r = await conn.next("result", (x) => x.invocationId === "big", 10_000);
  assert.equal(r.outcome.case, "permanentError");
  assert.equal(r.outcome.value.diagnostics[0].reason, "RESULT_TOO_LARGE");
  conn.send(invocation("log", "create", { log: true }));
  const l = await conn.next("result", (x) => x.invocationId === "log", 10_000);
  assert.equal(l.outcome.case, "success");
  assert.ok(!conn.received.some((m) => m.message.case === "log"));
  assert.ok(!conn.closed);
});

test("a cancel without a grace period waits for the handler; one with a grace period answers in time", async (t) => {
  const reg = new Registry();
  let release: () => void = () => {};
  const released = new Promise<void>((r) => (release = r));
  // This handler ignores its signal.
  reg.on.create(R, async () => {
    await released;
    return { done: true };
  }, { id: "create" });
  const { fake } = await harness(t, reg);
  // A short default grace in the welcome: the old code answered with it when the cancel had none.
  const { conn } = await fake.handshake(1, undefined, { cancelGracePeriod: durationFromMs(200) });
  conn.send(invocation("forever", "create", {}));
  await pause(50);
  conn.send(response({ message: { case: "cancel", value: { invocationId: "forever", reason: CancelReason.PAUSED } } }));
  await pause(600);
  assert.ok(!conn.received.some((m) => m.message.case === "result"), "answered before the handler finished");
  // A grace period of 40 days (past Node's timer limit) does not fire at once either.
  conn.send(invocation("long", "create", {}));
  await pause(50);
  conn.send(response({ message: { case: "cancel", value: { invocationId: "long", reason: CancelReason.PAUSED, gracePeriod: durationFromMs(40 * 86_400_000) } } }));
  await pause(300);
  assert.ok(!conn.received.some((m) => m.message.case === "result"));
  // A real grace period: answered cancelled within it.
  conn.send(invocation("short", "create", {}));
  await pause(50);
  conn.send(response({ message: { case: "cancel", value: { invocationId: "short", reason: CancelReason.PAUSED, gracePeriod: durationFromMs(300) } } }));
  assert.equal((await conn.next("result", (x) => x.invocationId === "short", 2000)).outcome.case, "cancelled");
  release();
  assert.equal((await conn.next("result", (x) => x.invocationId === "forever")).outcome.case, "success");
});

test("long timers never fire early", async () => {
  let fired = 0;
  const timer = longTimeout(() => fired++, 2 ** 31 + 1000);
  await pause(50);
  timer.cancel();
  assert.equal(fired, 0);
  await new Promise<void>((resolve) => longTimeout(resolve, 20));
});

test("reconnects leave no stop waiters behind; the stop clears every timer", async (t) => {
  const reg = new Registry();
  reg.on.create(R, () => 1, { id: "create" });
  const { fake, op, running } = await harness(t, reg);
  for (let n = 1; n <= 4; n++) {
    const { conn } = await fake.handshake(n);
    await pause(20);
    conn.call.emit("error", { code: grpc.status.UNAVAILABLE, details: "lost" });
  }
  const last = (await fake.handshake(5)).conn;
  last.send(response({ message: { case: "ping", value: { nonce: 1n } } }));
  await last.next("pong"); // welcomed
  const waiters = (op as unknown as { stopWaiters: Set<unknown> }).stopWaiters;
  assert.ok(waiters.size <= 2, `${waiters.size} stop waiters`);
  const timeouts = () => process.getActiveResourcesInfo().filter((r) => r === "Timeout").length;
  op.stop();
  const conn = fake.conns[4]!;
  await conn.next("goodbye");
  conn.call.end();
  const began = Date.now();
  await running;
  assert.ok(Date.now() - began < 2000);
  await pause(20);
  assert.equal(waiters.size, 0);
  // No timer of the SDK's is left to keep the process up (grpc-js may hold a few of its own).
  assert.ok(timeouts() <= 2, `${timeouts()} timers left`);
});

test("the reconnect backoff is not reset by a stream that ends soon after its welcome", async (t) => {
  const reg = new Registry();
  reg.on.create(R, () => 1, { id: "create" });
  const { fake } = await harness(t, reg);
  let gap = 0;
  for (let n = 1; n <= 6; n++) {
    const { conn } = await fake.handshake(n);
    conn.send(response({ message: { case: "ping", value: { nonce: 1n } } }));
    await conn.next("pong"); // welcomed
    const lost = Date.now();
    conn.call.emit("error", { code: grpc.status.UNAVAILABLE, details: "lost" });
    await fake.connection(n + 1, 10_000);
    gap = Date.now() - lost;
  }
  // 0.05 s doubling per failure, jittered in the upper half: the 6th wait is at least 0.8 s.
  assert.ok(gap >= 700, `the 6th reconnect came after ${gap} ms`);
});

test("past the outgoing buffer bound, log records are dropped (warned once); results never", async (t) => {
  const reg = new Registry();
  const chunk = "y".repeat(1024 * 1024);
  reg.on.create(R, (ctx) => {
    for (let i = 0; i < 40; i++) ctx.logger.info(chunk);
    return { done: true };
  }, { id: "create" });
  const logger = recorder();
  const { fake } = await harness(t, reg, logger);
  const { conn } = await fake.handshake(1);
  conn.send(invocation("flood", "create", {}));
  const r = await conn.next("result", (x) => x.invocationId === "flood", 20_000);
  assert.equal(r.outcome.case, "success");
  const logs = conn.received.filter((m) => m.message.case === "log").length;
  assert.ok(logs < 40, `${logs} log records sent`);
  assert.equal(logger.warnings.filter((w) => w.includes("outgoing buffer")).length, 1);
});

test("registration and flow-control values are checked", () => {
  const reg = new Registry();
  const fn = () => 1;
  for (const bad of [-1, 1.5, 2 ** 32, NaN]) {
    assert.throws(() => reg.on.create(R, fn, { id: `r${bad}`, retries: bad }), SetupError);
    assert.throws(() => reg.on.create(R, fn, { id: `m${bad}`, maxInFlight: bad }), SetupError);
  }
  reg.on.create(R, fn, { id: "ok", retries: 2 ** 32 - 1, maxInFlight: 0 });
  for (let i = reg.handlers.length; i < MAX_HANDLERS; i++) reg.on.create(R, fn, { id: `h${i}` });
  assert.throws(() => reg.on.create(R, fn, { id: "one-too-many" }), SetupError);
  const op = new Operator(reg, { logger: silentLogger, handleSignals: false });
  assert.throws(() => op.setMaxInFlight(undefined, 2 ** 32), SetupError);
  assert.throws(() => op.setMaxInFlight("ok", -1), SetupError);
  op.setMaxInFlight("ok", 3);
});

test("change handlers given a field are named <id>/<field>, as kopf names them", () => {
  const reg = new Registry();
  for (const kind of ["create", "update", "delete", "resume"] as const) {
    reg.on[kind](R, () => 1, { id: kind, field: "spec.size" });
  }
  reg.on.create(R, () => 1, { id: "plain" });
  assert.deepEqual(reg.handlers.map((h) => h.id), ["create/spec.size", "update/spec.size", "delete/spec.size", "resume/spec.size", "plain"]);
});

test("AdmissionError is a PermanentError", () => {
  const e = new AdmissionError("no", 403);
  assert.ok(e instanceof PermanentError);
  assert.equal(e.code, 403);
});

test("a parent cancelled before its sub-handlers ran is cancelled", async () => {
  const reg = new Registry();
  let subRan = false;
  reg.on.create(R, async (ctx) => {
    ctx.register("sub", () => {
      subRan = true;
    });
    await new Promise((r) => ctx.signal.addEventListener("abort", r, { once: true }));
    return "finished anyway";
  }, { id: "parent" });
  const kit = new TestKit(reg);
  const run = kit.start("parent", body);
  await pause(10);
  const out = await run.cancel("resource_deleted");
  assert.equal(out.status, "cancelled");
  assert.equal(subRan, false);
  // Sub-handlers that are finished or waiting leave the parent's own outcome.
  const run2 = kit.start("parent", body, { subhandlers: [{ id: "sub", retries: 0, success: true, failure: false }] });
  await pause(10);
  assert.equal((await run2.cancel("resource_deleted")).status, "success");
});

test("a sub-handler's TemporaryError without a delay waits its backoff", async () => {
  const reg = new Registry();
  reg.on.create(R, (ctx) => {
    ctx.register("sub", () => {
      throw new TemporaryError("later");
    }, { backoff: 7 });
  }, { id: "parent" });
  const out = await new TestKit(reg).invoke("parent", body);
  const sub = out.subhandlers.sub as { status: string; delay?: number };
  assert.equal(sub.status, "temporary");
  assert.equal(sub.delay, 7);
});

test("the test kit clears its deadline timer and abort listener", async () => {
  const reg = new Registry();
  reg.on.create(R, () => 1, { id: "quick" });
  const abort = new AbortController();
  const before = process.getActiveResourcesInfo().filter((r) => r === "Timeout").length;
  const out = await new TestKit(reg).invoke("quick", body, { signal: abort.signal, deadline: new Date(Date.now() + 3_600_000) });
  assert.equal(out.status, "success");
  assert.equal(getEventListeners(abort.signal, "abort").length, 0);
  assert.equal(process.getActiveResourcesInfo().filter((r) => r === "Timeout").length, before);
});

// A fake controller (a @grpc/grpc-js server on a Unix socket) drives an Operator through the
// stream: hello, welcome, invocations and results, pings, cancels, flow control, reconnects
// and the goodbye on stop.

import { test } from "node:test";
import assert from "node:assert/strict";
import { mkdtempSync, rmSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";
import * as grpc from "@grpc/grpc-js";
import { Operator, Registry, TemporaryError, silentLogger } from "../src/index";
import { response } from "../src/wire";
import { FakeController, invocation, json } from "./fake";
import { Capability } from "../src/gen/capstan/v1/runtime_service_pb";
import { CancelReason } from "../src/gen/capstan/v1/invocation_pb";

test("the stream: hello, results, pings, cancels, flow control, reconnect and goodbye", async (t) => {
  const dir = mkdtempSync(join(tmpdir(), "capstan-ts-"));
  const fake = new FakeController(join(dir, "capstan.sock"));
  await fake.start();
  t.after(() => {
    fake.stop();
    rmSync(dir, { recursive: true, force: true });
  });

  const reg = new Registry();
  reg.on.create("widgets.v1.example.com", async (ctx) => {
    if (ctx.spec.hang) await ctx.sleep(60);
    if (ctx.spec.fail) throw new TemporaryError("not yet", { delay: 2 });
    ctx.patch.status.seen = true;
    ctx.logger.info("created");
    return { size: ctx.spec.size };
  }, { id: "create" });
  const op = new Operator(reg, { endpoint: `unix://${join(dir, "capstan.sock")}`, logger: silentLogger, handleSignals: false, reconnectDelay: 0.05, shutdownGrace: 1 });
  const running = op.run();
  t.after(() => op.stop());

  const { conn, hello } = await fake.handshake(1);
  assert.equal(hello.sdk.name, "capstan-sdk-typescript");
  assert.match(hello.instanceId, /^[0-9a-f]{32}$/);
  assert.deepEqual(hello.handlers.map((h: any) => h.handlerId), ["create"]);
  assert.ok(hello.capabilities.includes(Capability.SUBHANDLERS));

  // A result with its patch and log record, the record first.
  conn.send(invocation("i1", "create", { size: 3 }));
  const r1 = await conn.next("result", (r) => r.invocationId === "i1");
  assert.equal(r1.outcome.case, "success");
  assert.deepEqual(json(r1.outcome.value.result), { size: 3 });
  assert.deepEqual(json(r1.patches[0].body), { status: { seen: true } });
  const logIndex = conn.received.findIndex((m) => m.message.case === "log");
  const resultIndex = conn.received.findIndex((m) => m.message.case === "result");
  assert.ok(logIndex >= 0 && logIndex < resultIndex);

  // A temporary error with its delay, and no patches.
  conn.send(invocation("i2", "create", { fail: true }));
  const r2 = await conn.next("result", (r) => r.invocationId === "i2");
  assert.equal(r2.outcome.case, "temporaryError");
  assert.equal(r2.outcome.value.retryAfter.seconds, 2n);
  assert.equal(r2.patches.length, 0);

  // An unknown handler id: a permanent error.
  conn.send(invocation("i3", "nope", {}));
  assert.equal((await conn.next("result", (r) => r.invocationId === "i3")).outcome.case, "permanentError");

  // A ping is answered while a handler hangs; a cancel ends it cancelled.
  conn.send(invocation("i4", "create", { hang: true }));
  await new Promise((r) => setTimeout(r, 100));
  conn.send(response({ message: { case: "ping", value: { nonce: 7n } } }));
  const pong = await conn.next("pong", (p) => p.nonce === 7n);
  assert.equal(pong.inFlight, 1);
  conn.send(response({ message: { case: "cancel", value: { invocationId: "i4", reason: CancelReason.RESOURCE_DELETED } } }));
  assert.equal((await conn.next("result", (r) => r.invocationId === "i4", 2000)).outcome.case, "cancelled");

  // Flow control goes out now, and again after a reconnect.
  op.setMaxInFlight("create", 2);
  const flow = await conn.next("flowControl");
  assert.deepEqual([flow.handlerId, flow.maxInFlight], ["create", 2]);
  conn.call.emit("error", { code: grpc.status.UNAVAILABLE, details: "lost" });
  const second = await fake.handshake(2);
  assert.equal(second.hello.instanceId, hello.instanceId);
  await second.conn.next("flowControl", (f) => f.handlerId === "create" && f.maxInFlight === 2);

  // Stop: goodbye, the running invocation's result, then our side closes.
  second.conn.send(invocation("i5", "create", { hang: true }));
  await new Promise((r) => setTimeout(r, 100));
  op.stop();
  const goodbye = await second.conn.next("goodbye");
  assert.equal(goodbye.cleanup, false);
  const r5 = await second.conn.next("result", (r) => r.invocationId === "i5", 5000);
  assert.equal(r5.outcome.case, "cancelled");
  assert.ok(await second.conn.closedWithin(5000));
  second.conn.call.end();
  await running;
});

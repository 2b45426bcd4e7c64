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
import { decodeRequest, encodeResponse, response } from "../src/wire";
import type { ConnectRequest, ConnectResponse } from "../src/wire";
import { Capability } from "../src/gen/capstan/v1/runtime_service_pb";
import { CancelReason } from "../src/gen/capstan/v1/invocation_pb";

type Call = grpc.ServerDuplexStream<ConnectRequest, ConnectResponse>;

/** One connection of the fake controller: what came in, and a way to wait for more. */
class Conn {
  readonly received: ConnectRequest[] = [];
  private waiters: (() => void)[] = [];
  closed = false;
  constructor(readonly call: Call) {
    call.on("data", (m: ConnectRequest) => {
      this.received.push(m);
      for (const w of this.waiters.splice(0)) w();
    });
    call.on("end", () => {
      this.closed = true;
      for (const w of this.waiters.splice(0)) w();
    });
    call.on("error", () => {});
  }
  send(m: ConnectResponse): void {
    this.call.write(m);
  }
  /** Waits for a message matching `pred`. */
  async next<C extends ConnectRequest["message"]["case"]>(kind: C, pred: (v: any) => boolean = () => true, ms = 5000): Promise<any> {
    const deadline = Date.now() + ms;
    for (;;) {
      const found = this.received.find((m) => m.message.case === kind && pred(m.message.value));
      if (found) return found.message.value;
      const left = deadline - Date.now();
      if (left <= 0) throw new Error(`no ${kind} within ${ms} ms; got ${this.received.map((m) => m.message.case).join(",")}`);
      await new Promise<void>((resolve) => {
        const t = setTimeout(resolve, left);
        this.waiters.push(() => { clearTimeout(t); resolve(); });
      });
    }
  }
  async closedWithin(ms: number): Promise<boolean> {
    const deadline = Date.now() + ms;
    while (!this.closed && Date.now() < deadline) await new Promise((r) => setTimeout(r, 20));
    return this.closed;
  }
}

class FakeController {
  readonly server = new grpc.Server();
  readonly conns: Conn[] = [];
  private waiters: (() => void)[] = [];
  constructor(readonly socket: string) {
    this.server.addService(
      {
        Connect: {
          path: "/capstan.v1.RuntimeService/Connect",
          requestStream: true,
          responseStream: true,
          requestSerialize: () => Buffer.from([]),
          requestDeserialize: (b: Buffer) => decodeRequest(b),
          responseSerialize: (m: ConnectResponse) => encodeResponse(m),
          responseDeserialize: () => undefined as never,
        },
      } as grpc.ServiceDefinition,
      {
        Connect: (call: Call) => {
          this.conns.push(new Conn(call));
          for (const w of this.waiters.splice(0)) w();
        },
      },
    );
  }
  start(): Promise<void> {
    return new Promise((resolve, reject) =>
      this.server.bindAsync(`unix://${this.socket}`, grpc.ServerCredentials.createInsecure(), (err) => (err ? reject(err) : resolve())),
    );
  }
  async connection(n: number, ms = 5000): Promise<Conn> {
    const deadline = Date.now() + ms;
    while (this.conns.length < n) {
      if (Date.now() > deadline) throw new Error(`no connection #${n}`);
      await new Promise<void>((resolve) => {
        const t = setTimeout(resolve, 50);
        this.waiters.push(() => { clearTimeout(t); resolve(); });
      });
    }
    return this.conns[n - 1]!;
  }
  /** Waits for hello and answers welcome, accepting every handler. */
  async handshake(n: number, capabilities: Capability[] = [Capability.RESULT_ACK, Capability.SUBHANDLERS, Capability.OBJECT_UPDATES]) {
    const conn = await this.connection(n);
    const hello = await conn.next("hello");
    conn.send(
      response({
        message: {
          case: "welcome",
          value: {
            connectionId: String(n),
            capabilities,
            limits: { maxMessageBytes: 16n << 20n, maxInFlight: 256 },
            registrations: hello.handlers.map((h: any) => ({ handlerId: h.handlerId, accepted: true })),
          },
        },
      }),
    );
    return { conn, hello };
  }
  stop(): void {
    this.server.forceShutdown();
  }
}

function invocation(id: string, handlerId: string, spec: unknown, extra: Record<string, unknown> = {}): ConnectResponse {
  const body = { apiVersion: "example.com/v1", kind: "Widget", metadata: { name: "w", namespace: "ns", uid: "uid-w" }, spec };
  return response({
    message: {
      case: "invocation",
      value: {
        invocationId: id,
        handlerId,
        attempt: 1,
        idempotencyKey: id,
        resource: { group: "example.com", version: "v1", plural: "widgets", namespace: "ns", name: "w", uid: "uid-w" },
        body: { json: new TextEncoder().encode(JSON.stringify(body)) },
        payload: { case: "change", value: { reason: 1 } },
        ...extra,
      },
    },
  });
}

const json = (j: { json: Uint8Array } | undefined) => (j ? JSON.parse(new TextDecoder().decode(j.json)) : undefined);

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

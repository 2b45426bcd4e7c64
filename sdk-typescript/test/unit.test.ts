// Unit tests of the context, errors, patches, diffs, sub-handlers, indexes and memos, through
// the test kit (the same code that runs under the controller).

import { test } from "node:test";
import assert from "node:assert/strict";
import { AdmissionError, PermanentError, Patch, Registry, TemporaryError, sleep, NONE_KEY } from "../src/index";
import { TestKit, diffOf } from "../src/testing";
import { Memos } from "../src/memo";
import { backoff, onlyTaken, target } from "../src/runtime";
import { registration, resultRequest, decodeRequest, decodeResponse, encodeRequest, encodeResponse, invocationData, response } from "../src/wire";
import { create, fromBinary, toBinary } from "@bufbuild/protobuf";
import { InvocationSchema } from "../src/gen/capstan/v1/invocation_pb";
import { ConnectRequestSchema, ConnectResponseSchema } from "../src/gen/capstan/v1/runtime_service_pb";
import { fastInvocationResponse } from "../src/codec";

const R = "widgets.v1.example.com";
const body = (spec: Record<string, unknown> = {}, extra: Record<string, unknown> = {}) => ({
  apiVersion: "example.com/v1",
  kind: "Widget",
  metadata: { name: "w1", namespace: "ns", uid: "u1", labels: { team: "blue" }, ...extra },
  spec,
  status: { phase: "New" },
});

test("the context gives kopf's arguments", async () => {
  const reg = new Registry();
  let seen: Record<string, unknown> = {};
  reg.on.create(
    R,
    (ctx) => {
      seen = {
        name: ctx.name,
        namespace: ctx.namespace,
        uid: ctx.uid,
        spec: ctx.spec,
        meta: ctx.meta.name,
        status: ctx.status,
        labels: ctx.labels,
        retry: ctx.retry,
        param: ctx.param,
        reason: ctx.reason,
        old: ctx.old,
        runtimeOk: ctx.runtime >= 0 && ctx.runtime < 5,
        started: ctx.started instanceof Date,
        aborted: ctx.signal.aborted,
      };
    },
    { id: "c", param: { p: 1 } },
  );
  const kit = new TestKit(reg);
  const out = await kit.invoke("c", body({ size: 3 }), { attempt: 3 });
  assert.equal(out.status, "success");
  assert.deepEqual(seen, {
    name: "w1",
    namespace: "ns",
    uid: "u1",
    spec: { size: 3 },
    meta: "w1",
    status: { phase: "New" },
    labels: { team: "blue" },
    retry: 2,
    param: { p: 1 },
    reason: "create",
    old: null,
    runtimeOk: true,
    started: true,
    aborted: false,
  });
});

test("errors are classified as kopf classifies them", async () => {
  const reg = new Registry();
  reg.on.create(R, () => { throw new TemporaryError("later", { delay: 1.5 }); }, { id: "t" });
  reg.on.create(R, () => { throw new TemporaryError("later"); }, { id: "t0" });
  reg.on.create(R, () => { throw new PermanentError("never"); }, { id: "p" });
  reg.on.create(R, () => { throw new RangeError("boom"); }, { id: "u" });
  reg.on.create(R, () => { throw "a string"; }, { id: "s" });
  const kit = new TestKit(reg);
  const t = await kit.invoke("t", body());
  assert.equal(t.status, "temporary");
  assert.equal(t.delay, 1.5);
  assert.equal(t.message, "later");
  assert.equal((await kit.invoke("t0", body())).delay, undefined);
  assert.equal((await kit.invoke("p", body())).status, "permanent");
  const u = await kit.invoke("u", body());
  assert.equal(u.status, "unclassified");
  assert.equal(u.outcome.status === "unclassified" && u.outcome.diagnostic.errorType, "RangeError");
  assert.equal((await kit.invoke("s", body())).message, "a string");
});

test("a cancelled handler ends cancelled; one that ignores the cancel keeps its outcome", async () => {
  const reg = new Registry();
  reg.daemon(R, async (ctx) => { await ctx.sleep(60); }, { id: "d" });
  reg.on.create(R, async () => { await sleep(0.05); return "done"; }, { id: "c" });
  const kit = new TestKit(reg);
  const d = kit.start("d", body());
  await sleep(0.02);
  const out = await d.cancel();
  assert.equal(out.status, "cancelled");
  assert.equal(d.context.cancelReason, "resource_deleted");
  const ac = new AbortController();
  const c = kit.invoke("c", body(), { signal: ac.signal });
  ac.abort();
  assert.equal((await c).result, "done");
});

test("the deadline aborts the handler's signal", async () => {
  const reg = new Registry();
  reg.on.create(R, async (ctx) => { await ctx.sleep(30); }, { id: "c" });
  const out = await new TestKit(reg).invoke("c", body(), { deadline: new Date(Date.now() + 50) });
  assert.equal(out.status, "cancelled");
});

test("patches merge deeply, and status goes to the status subresource", () => {
  const p = new Patch();
  p.merge({ spec: { a: 1 } });
  p.merge({ spec: { b: { c: 2 } } });
  p.label("ready", "yes");
  p.status.phase = "Ready";
  p.set("spec.b.d", null);
  assert.deepEqual(p.toDocuments(), [
    { type: "merge", target: "object", body: { spec: { a: 1, b: { c: 2, d: null } }, metadata: { labels: { ready: "yes" } } } },
    { type: "merge", target: "status", body: { status: { phase: "Ready" } } },
  ]);
  const empty = new Patch();
  void empty.metadata;
  void empty.status;
  assert.equal(empty.isEmpty(), true);
  assert.deepEqual(empty.toDocuments(), []);
});

test("patches of failures are not sent", async () => {
  const reg = new Registry();
  reg.on.update(R, (ctx) => { ctx.patch.spec.x = 1; throw new TemporaryError("no"); }, { id: "u" });
  reg.on.update(R, (ctx) => { ctx.patch.spec.x = 1; ctx.patch.status.y = 2; }, { id: "ok" });
  const kit = new TestKit(reg);
  assert.deepEqual((await kit.invoke("u", body())).patches, []);
  assert.deepEqual((await kit.invoke("ok", body())).patch, { spec: { x: 1 }, status: { y: 2 } });
});

test("diffs are kopf's", () => {
  assert.deepEqual(diffOf({ spec: { a: 1, b: 2 } }, { spec: { a: 2, c: 3 } }), [
    ["change", ["spec", "a"], 1, 2],
    ["remove", ["spec", "b"], 2, null],
    ["add", ["spec", "c"], null, 3],
  ]);
  assert.deepEqual(diffOf(null, { a: 1 }), [["add", [], null, { a: 1 }]]);
  assert.deepEqual(diffOf(1, 1), []);
});

test("field handlers are named <id>/<field> and see the field's values", async () => {
  const reg = new Registry();
  reg.on.field(R, "spec.size", (ctx) => ({ old: ctx.old, new: ctx.new, diff: ctx.diff, field: ctx.field }), { id: "f" });
  assert.equal(reg.handlers[0]!.id, "f/spec.size");
  const out = await new TestKit(reg).invoke("f/spec.size", body({ size: 2 }), { old: 1, new: 2 });
  assert.deepEqual(out.result, { old: 1, new: 2, diff: [["change", [], 1, 2]], field: "spec.size" });
});

test("sub-handlers run after the parent, skipping finished and waiting ones", async () => {
  const reg = new Registry();
  const ran: string[] = [];
  reg.on.create(
    R,
    (ctx) => {
      for (const id of ["a", "b", "c", "d"]) {
        ctx.register(id, (sub) => {
          ran.push(sub.handlerId);
          sub.patch.label(id, "yes");
          if (id === "d") throw new TemporaryError("wait", { delay: 5 });
          return { retry: sub.retry };
        });
      }
    },
    { id: "parent" },
  );
  const kit = new TestKit(reg);
  const out = await kit.invoke("parent", body(), {
    subhandlers: [
      { id: "a", retries: 0, success: true, failure: false },
      { id: "b", retries: 1, success: false, failure: false, delayedUntil: new Date(Date.now() + 60_000) },
      { id: "c", retries: 2, success: false, failure: false, delayedUntil: new Date(Date.now() - 1000) },
    ],
  });
  assert.deepEqual(ran, ["parent/c", "parent/d"]);
  assert.equal(out.status, "success");
  assert.deepEqual(out.subhandlers.c, { status: "success", result: { retry: 2 } });
  assert.equal(out.subhandlers.d!.status, "temporary");
  assert.deepEqual(out.patch, { metadata: { labels: { c: "yes" } } });
});

test("a parent that fails runs no sub-handlers; a sub-handler's own options judge it", async () => {
  const reg = new Registry();
  reg.on.create(R, (ctx) => { ctx.register("a", () => 1); throw new TemporaryError("x"); }, { id: "p" });
  reg.on.create(
    R,
    (ctx) => {
      ctx.register("ign", () => { throw new Error("x"); }, { errors: "ignored" });
      ctx.register("lim", () => { throw new TemporaryError("x"); }, { retries: 2 });
    },
    { id: "q" },
  );
  const kit = new TestKit(reg);
  assert.deepEqual((await kit.invoke("p", body())).subhandlerOutcomes, []);
  const q = await kit.invoke("q", body(), { subhandlers: [{ id: "lim", retries: 1, success: false, failure: false }] });
  assert.equal(q.subhandlers.ign!.status, "success");
  assert.equal(q.subhandlers.lim!.status, "permanent");
});

test("an SDK-side filter skips", async () => {
  const reg = new Registry();
  reg.on.create(R, () => "ran", { id: "w", when: (ctx) => ctx.spec.ok === true });
  const kit = new TestKit(reg);
  assert.equal((await kit.invoke("w", body({ ok: false }))).status, "skipped");
  assert.equal((await kit.invoke("w", body({ ok: true }))).result, "ran");
});

test("admission verdicts, warnings and mutations", async () => {
  const reg = new Registry();
  reg.on.validate(R, (ctx) => { ctx.warnings.push("careful"); if (ctx.spec.bad) throw new AdmissionError("bad", 422); }, { id: "v" });
  reg.on.mutate(R, (ctx) => { ctx.patch.label("m", "1"); }, { id: "m" });
  const kit = new TestKit(reg);
  assert.deepEqual((await kit.invoke("v", body({ bad: true }))).verdict, { allowed: false, message: "bad", code: 422, warnings: ["careful"] });
  assert.deepEqual((await kit.invoke("v", body())).verdict, { allowed: true, warnings: ["careful"] });
  const m = await kit.invoke("m", body());
  assert.deepEqual(m.patches, [{ type: "merge", target: "object", body: { metadata: { labels: { m: "1" } } } }]);
});

test("logs and events are recorded; events are always posted", async () => {
  const reg = new Registry();
  reg.on.create(R, (ctx) => { ctx.logger.info("hello"); ctx.logger.warning("careful"); ctx.event("Normal", "Done", "all good"); }, { id: "c" });
  const out = await new TestKit(reg).invoke("c", body());
  assert.deepEqual(out.logs, [["info", "hello"], ["warning", "careful"]]);
  assert.deepEqual(out.events, [{ type: "Normal", reason: "Done", message: "all good" }]);
});

test("indexes fold kopf's way and handlers read them", async () => {
  const reg = new Registry();
  reg.index(R, (ctx) => (ctx.spec.none ? "plain" : { [ctx.labels.team ?? "none"]: ctx.name }), { id: "byteam" });
  reg.on.create(R, (ctx) => ctx.index("byteam").get("blue"), { id: "reader" });
  const kit = new TestKit(reg);
  await kit.invoke("byteam", body());
  await kit.invoke("byteam", body({}, { name: "w2", uid: "u2" }));
  await kit.invoke("byteam", body({ none: true }, { name: "w3", uid: "u3" }));
  assert.deepEqual((await kit.invoke("reader", body())).result, ["w1", "w2"]);
  assert.deepEqual(kit.index("byteam").get(NONE_KEY), ["plain"]);
  await kit.invoke("byteam", body(), { indexDeleted: true });
  assert.deepEqual(kit.index("byteam").get("blue"), ["w2"]);
  assert.equal((await kit.invoke("reader", body())).status, "success");
});

test("memos are per object, start from the operator's memo, and can be dropped", () => {
  const memos = new Memos({ shared: 1 }, 2);
  const a = memos.get("a");
  a.x = 1;
  assert.deepEqual(memos.get("a"), { shared: 1, x: 1 });
  memos.get("b");
  memos.get("c"); // beyond the cap: the least recently used ("a") goes
  assert.equal(memos.has("a"), false);
  memos.drop("b");
  assert.equal(memos.has("b"), false);
  assert.equal(memos.get(""), memos.operator);
});

test("login returns credentials; probes return values", async () => {
  const reg = new Registry();
  reg.on.login(() => ({ server: "https://x", token: "t" }), { id: "login" });
  reg.on.probe(() => ({ ok: true }), { id: "probe" });
  const kit = new TestKit(reg);
  assert.deepEqual((await kit.invoke("login")).credentials, { server: "https://x", token: "t" });
  assert.deepEqual((await kit.invoke("probe")).result, { ok: true });
});

test("registrations carry the options on the wire", () => {
  const reg = new Registry();
  reg.on.update({ group: "g", version: "v1", plural: "ws" }, () => {}, { id: "u", retries: 3, backoff: 2, timeout: 30, param: { p: 1 }, errors: "permanent", when: () => true });
  reg.timer(R, () => {}, { id: "t", interval: 1.5 });
  const u = registration(reg.handlers[0]!);
  assert.equal(u.retries, 3);
  assert.equal(u.filters?.sdkWhen, true);
  assert.equal(u.resource?.name, "ws");
  const t = registration(reg.handlers[1]!);
  assert.equal(t.kindOptions?.case, "timer");
  assert.throws(() => reg.timer(R, () => {}, { id: "bad", interval: 0 }));
  assert.throws(() => reg.on.create(R, () => {}, { id: "u" }), /duplicate/);
  assert.throws(() => reg.on.create(R, () => {}), /needs an id/);
});

test("results round-trip through the wire", () => {
  const m = decodeRequest(
    encodeRequest(resultRequest("i1", { outcome: { status: "temporary", message: "x", delay: 1.5, diagnostic: { summary: "x" } }, patches: [], subhandlers: [], duration: 0.2 })),
  );
  assert.equal(m.message.case, "result");
  if (m.message.case !== "result") return;
  assert.equal(m.message.value.outcome.case, "temporaryError");
  if (m.message.value.outcome.case !== "temporaryError") return;
  assert.equal(m.message.value.outcome.value.retryAfter?.seconds, 1n);
  assert.equal(m.message.value.outcome.value.retryAfter?.nanos, 500_000_000);
  const inv = create(InvocationSchema, { invocationId: "i", handlerId: "h", attempt: 2, body: { json: new TextEncoder().encode('{"spec":{"a":1}}') } });
  const data = invocationData(inv, "create");
  assert.deepEqual(data.body, { spec: { a: 1 } });
  assert.equal(data.attempt, 2);
});

test("the hand-written codec of invocations and results agrees with the reflective one", () => {
  const json = (v: unknown) => ({ json: new TextEncoder().encode(JSON.stringify(v)) });
  const ts = (s: number) => ({ seconds: BigInt(s), nanos: 7 });
  const base = {
    invocationId: "inv-1",
    handlerId: "create_fn",
    attempt: 3,
    idempotencyKey: "k",
    resource: { group: "g", version: "v1", kind: "K", plural: "ks", namespace: "ns", name: "n", uid: "u", resourceVersion: "9", generation: 4n },
    body: json({ metadata: { name: "n" }, spec: { a: 1 } }),
  };
  const invocations = [
    base,
    { ...base, resource: undefined, body: undefined, attempt: 0 },
    {
      ...base,
      deadline: ts(100),
      startedTime: ts(50),
      traceContext: { traceparent: "00-abc", x: "y" },
      lastError: { summary: "boom", reason: "R" },
      param: json({ p: [1, 2] }),
      subhandlers: [{ subhandlerId: "s1", retries: 2, success: true, delayedUntil: ts(9), message: "m" }],
      payload: { case: "change" as const, value: { reason: 2, old: json({ a: 1 }), new: json({ a: 2 }), field: "spec.a", diff: [{ operation: 2, path: ["spec", "a"], old: json(1), new: json(2) }] } },
    },
    { ...base, payload: { case: "daemon" as const, value: { restarts: 4 } } },
    { ...base, payload: { case: "admission" as const, value: { uid: "a", operation: "CREATE", dryRun: true, oldObject: json({}), headers: { h: "v" } } } },
  ];
  const plain = (v: unknown) =>
    JSON.parse(JSON.stringify(v, (_, x) => (typeof x === "bigint" ? `${x}n` : x instanceof Uint8Array ? Buffer.from(x).toString("hex") : x)));
  for (const value of invocations) {
    const bytes = encodeResponse(response({ message: { case: "invocation", value } }));
    assert.ok(fastInvocationResponse(bytes), "decoded by hand");
    assert.deepEqual(plain(decodeResponse(bytes)), plain(fromBinary(ConnectResponseSchema, bytes)));
  }
  const ping = encodeResponse(response({ message: { case: "ping", value: { nonce: 5n } } }));
  assert.equal(fastInvocationResponse(ping), undefined);
  assert.equal(decodeResponse(ping).message.case, "ping");

  const outcomes = [
    { outcome: { status: "success" as const }, patches: [], subhandlers: [], duration: 0.00001 },
    {
      outcome: { status: "success" as const, result: { message: "hello", attempts: 2 } },
      patches: [
        { type: "merge" as const, target: "object" as const, body: { metadata: { labels: { a: "1" } } } },
        { type: "json" as const, target: "status" as const, body: [{ op: "add", path: "/status/x", value: 1 }] },
      ],
      subhandlers: [],
      duration: 12345.6789,
    },
  ];
  for (const out of outcomes) {
    const fast = encodeRequest(resultRequest("inv-1", out));
    const m = decodeRequest(fast);
    assert.deepEqual(Buffer.from(toBinary(ConnectRequestSchema, m)), fast);
    assert.equal(m.message.case, "result");
  }
});

test("reconnects back off with jitter; HANDLER_ID_TAKEN alone is retried; endpoints", () => {
  for (let i = 0; i < 20; i++) {
    const d = backoff(0);
    assert.ok(d >= 0.125 && d <= 0.25);
    const e = backoff(20);
    assert.ok(e >= 15 && e <= 30);
  }
  assert.equal(onlyTaken("NO_HANDLERS_ACCEPTED: x (a: [HANDLER_ID_TAKEN] held; b: [HANDLER_ID_TAKEN] held)"), true);
  assert.equal(onlyTaken("NO_HANDLERS_ACCEPTED: x (a: [UNKNOWN_RESOURCE] no; b: [HANDLER_ID_TAKEN] held)"), false);
  assert.equal(onlyTaken("NO_HANDLERS_ACCEPTED: nothing"), false);
  assert.equal(target("unix:///run/x.sock"), "unix:///run/x.sock");
  assert.equal(target("127.0.0.1:9000"), "127.0.0.1:9000");
});

test("the context's methods work destructured", async () => {
  const reg = new Registry();
  reg.on.create(R, ({ event, info, register, logger }) => {
    event("Normal", "A", "a");
    info("B", "b");
    register("sub", () => 1);
    logger.info("c");
  }, { id: "c" });
  const out = await new TestKit(reg).invoke("c", body());
  assert.equal(out.status, "success");
  assert.equal(out.events.length, 2);
  assert.equal(out.subhandlers.sub!.status, "success");
});

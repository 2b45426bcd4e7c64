// The handler process's side of the capstan.v1 stream: dialling, the handshake, the reader
// loop, the invocations running on a stream, shutdown and reconnects.

import { randomBytes } from "node:crypto";
import * as grpc from "@grpc/grpc-js";
import { durationMs } from "@bufbuild/protobuf/wkt";
import { Context, LazyAbort } from "./context";
import type { LogOut, Sink } from "./context";
import { execute, classify } from "./engine";
import { CancelledError, SetupError } from "./errors";
import type { CancelReason } from "./errors";
import { Indexes } from "./indexes";
import { longTimeout } from "./timers";
import type { Timer } from "./timers";
import { stderrLogger } from "./logger";
import type { Logger } from "./logger";
import { Memos } from "./memo";
import { checkUint32, getDefaultRegistry } from "./registry";
import type { Registry } from "./registry";
import type { InvocationOutcome, JsonObject } from "./types";
import { Capability } from "./gen/capstan/v1/runtime_service_pb";
import type { Welcome } from "./gen/capstan/v1/runtime_service_pb";
import type { Cancel, Invocation } from "./gen/capstan/v1/invocation_pb";
import {
  cancelReason,
  decodeJson,
  decodeResponse,
  encodeRequest,
  invocationData,
  logRequest,
  registration,
  rejection,
  request,
  resultRequest,
  updateRequest,
} from "./wire";
import type { ConnectRequest, ConnectResponse } from "./wire";

/** The SDK's name and version, sent in `hello`. */
export const SDK_NAME = "capstan-sdk-typescript";
export const SDK_VERSION = "0.1.0";

/** Where the controller listens unless configured otherwise. */
export const DEFAULT_ENDPOINT = "unix:///run/capstan/capstan.sock";

/** The protocol's message size limit, both ways: 16 MiB. */
export const MAX_MESSAGE_BYTES = 16 * 1024 * 1024;

/** Past this many bytes waiting to be written, log records and interim updates are dropped. */
export const OUTGOING_BUFFER_LIMIT = 8 * 1024 * 1024;

/** A stream that stayed up this long resets the reconnect backoff. */
const STABLE_STREAM_MS = 30_000;

const METHOD = "/capstan.v1.RuntimeService/Connect";

/** The capabilities this SDK implements. */
const CAPABILITIES = [
  Capability.RESULT_ACK,
  Capability.INVOCATION_UPDATES,
  Capability.SDK_FILTERS,
  Capability.SUBHANDLERS,
  Capability.OBJECT_UPDATES,
  Capability.OBJECT_GONE,
  Capability.CLEANUP_ON_GOODBYE,
];

/** How {@link Operator.run} connects and stops. Durations are in seconds. */
export interface RunOptions {
  /** The controller's endpoint: `unix:///path.sock`, or a loopback `host:port`. Default: `$CAPSTAN_ENDPOINT`, else {@link DEFAULT_ENDPOINT}. */
  endpoint?: string;
  /** The SDK's local log (default: standard error). */
  logger?: Logger;
  /** How long running invocations may finish after a stop before they are cancelled (10). */
  shutdownGrace?: number;
  /** How long a stop waits for the controller to run the cleanup handlers (20). */
  cleanupTimeout?: number;
  /** A process-wide in-flight cap asked for in `hello` (0: the controller's default). */
  maxInFlight?: number;
  /** Stop gracefully on SIGTERM and SIGINT (true). */
  handleSignals?: boolean;
  /** The first reconnect delay (0.25) and the cap (30). */
  reconnectDelay?: number;
  maxReconnectDelay?: number;
  /** How long to wait for `welcome` after `hello` (30). */
  handshakeTimeout?: number;
}

export { SetupError };

/**
 * One handler process: serves a registry's handlers to the controller until stopped. Most
 * operators use {@link run}; an Operator is for several registries or explicit control.
 */
export class Operator {
  readonly logger: Logger;
  readonly memos: Memos;
  private readonly instanceId = randomBytes(16).toString("hex");
  private stopRequested = false;
  private readonly stopWaiters = new Set<() => void>();
  private session: Session | undefined;
  private readonly flows = new Map<string, number>();

  constructor(
    readonly registry: Registry = getDefaultRegistry(),
    readonly options: RunOptions = {},
  ) {
    this.logger = options.logger ?? stderrLogger();
    this.memos = new Memos(registry.memo);
  }

  /** The endpoint this operator dials. */
  get endpoint(): string {
    return this.options.endpoint || process.env.CAPSTAN_ENDPOINT || DEFAULT_ENDPOINT;
  }

  /**
   * Caps how many invocations of one handler (or, without a handler id, of the whole process)
   * the controller dispatches at once; 0 pauses dispatch. Sent as `flow_control` now and again
   * after every reconnect.
   */
  setMaxInFlight(handlerId: string | undefined, n: number): void {
    checkUint32("max in flight", n);
    this.flows.set(handlerId ?? "", n);
    this.session?.sendFlow(handlerId ?? "", n);
  }

  /** Asks the operator to stop: goodbye, let running invocations finish, close. */
  stop(): void {
    if (this.stopRequested) return;
    this.stopRequested = true;
    const waiters = [...this.stopWaiters];
    this.stopWaiters.clear();
    for (const w of waiters) w();
  }

  /** @internal calls `fn` once when a stop is requested (at once if it was); returns a function that unsubscribes. */
  onStop(fn: () => void): () => void {
    if (this.stopRequested) {
      fn();
      return () => {};
    }
    this.stopWaiters.add(fn);
    return () => this.stopWaiters.delete(fn);
  }

  /** @internal resolves when a stop is requested. */
  stopped(): Promise<void> {
    if (this.stopRequested) return Promise.resolve();
    return new Promise((resolve) => this.stopWaiters.add(resolve));
  }

  get stopping(): boolean {
    return this.stopRequested;
  }

  /**
   * Connects and serves until stopped. Reconnects with jittered exponential backoff when the
   * stream ends; rejects with a {@link SetupError} when the controller accepted no handler
   * (FAILED_PRECONDITION, unless every reason is HANDLER_ID_TAKEN).
   */
  async run(): Promise<void> {
    if (this.registry.handlers.length === 0) throw new SetupError("capstan: no handlers registered");
    checkUint32("maxInFlight", this.options.maxInFlight);
    const hello = request({
      message: {
        case: "hello",
        value: {
          capabilities: CAPABILITIES,
          sdk: { name: SDK_NAME, version: SDK_VERSION, language: "typescript" },
          instanceId: this.instanceId,
          handlers: this.registry.handlers.map(registration),
          maxInFlight: this.options.maxInFlight ?? 0,
        },
      },
    });
    const onSignal = () => {
      this.logger.info("capstan: stopping on a signal");
      this.stop();
    };
    const handleSignals = this.options.handleSignals ?? true;
    if (handleSignals) {
      process.on("SIGTERM", onSignal);
      process.on("SIGINT", onSignal);
    }
    try {
      let failures = 0;
      while (!this.stopRequested) {
        const client = new grpc.Client(target(this.endpoint), grpc.credentials.createInsecure(), {
          "grpc.max_receive_message_length": MAX_MESSAGE_BYTES,
          "grpc.max_send_message_length": MAX_MESSAGE_BYTES,
          "grpc.keepalive_time_ms": 30_000,
          "grpc.keepalive_timeout_ms": 10_000,
          "grpc.keepalive_permit_without_calls": 1,
          "grpc.enable_retries": 0,
          "grpc.use_local_subchannel_pool": 1,
        });
        let end: StreamEnd;
        try {
          end = await this.connect(client, hello);
        } finally {
          client.close();
        }
        if (this.stopRequested) return;
        if (end.fatal) throw new SetupError(end.fatal);
        if (end.code === grpc.status.FAILED_PRECONDITION && !onlyTaken(end.details)) {
          throw new SetupError(`capstan: the controller accepted no handler: ${end.details}`);
        }
        if (end.welcomed && end.upMs >= STABLE_STREAM_MS) failures = 0;
        const delay = backoff(failures++, this.options.reconnectDelay ?? 0.25, this.options.maxReconnectDelay ?? 30);
        this.logger.warn("capstan: not connected to the controller; retrying", {
          endpoint: this.endpoint,
          code: grpc.status[end.code] ?? end.code,
          details: end.details,
          in: `${delay.toFixed(3)}s`,
        });
        await new Promise<void>((resolve) => {
          const done = () => {
            timer.cancel();
            off();
            resolve();
          };
          const timer = longTimeout(done, delay * 1000);
          const off = this.onStop(done);
        });
      }
    } finally {
      if (handleSignals) {
        process.off("SIGTERM", onSignal);
        process.off("SIGINT", onSignal);
      }
    }
  }

  /** One stream: hello, welcome, then the session until it ends or the operator stops. */
  private connect(client: grpc.Client, hello: ConnectRequest): Promise<StreamEnd> {
    return new Promise<StreamEnd>((resolve) => {
      const call = client.makeBidiStreamRequest<ConnectRequest, ConnectResponse>(METHOD, encodeRequest, decodeResponse, new grpc.Metadata());
      let session: Session | undefined;
      let settled = false;
      let welcomed = false;
      let welcomedAt = 0;
      let fatal: string | undefined;
      const offStop: (() => void)[] = [];
      const finish = (code: number, details: string) => {
        if (settled) return;
        settled = true;
        clearTimeout(handshakeTimer);
        for (const off of offStop.splice(0)) off();
        if (session) {
          session.ended(code, details);
          if (this.session === session) this.session = undefined;
        }
        resolve({ code, details, welcomed, upMs: welcomed ? Date.now() - welcomedAt : 0, fatal });
      };
      const handshakeTimer = setTimeout(
        () => {
          this.logger.warn("capstan: no welcome in time; dialling again");
          call.cancel();
        },
        (this.options.handshakeTimeout ?? 30) * 1000,
      );
      const stopDuringHandshake = () => {
        if (!welcomed && !settled) call.cancel();
      };
      offStop.push(this.onStop(stopDuringHandshake));

      call.on("data", (m: ConnectResponse) => {
        if (session) {
          session.receive(m);
          return;
        }
        if (m.message.case !== "welcome") {
          this.logger.warn("capstan: the controller sent something before welcome", { message: m.message.case });
          call.cancel();
          return;
        }
        clearTimeout(handshakeTimer);
        welcomed = true;
        welcomedAt = Date.now();
        const unsupported = this.logWelcome(m.message.value);
        if (unsupported) {
          fatal = unsupported;
          call.end();
          call.cancel();
          return;
        }
        session = new Session(this, call, m.message.value);
        this.session = session;
        for (const [id, n] of this.flows) session.sendFlow(id, n);
        const s = session;
        offStop.push(
          this.onStop(() => {
            s.shutdown().catch((error) => this.logger.error("capstan: the shutdown failed", { error: String(error) }));
          }),
        );
      });
      call.on("status", (s: grpc.StatusObject) => finish(s.code, s.details));
      call.on("error", (e: grpc.ServiceError) => finish(e.code ?? grpc.status.UNKNOWN, e.details ?? e.message));
      call.on("end", () => {
        // The server closed its side; the status follows.
      });
      call.write(hello);
    });
  }

  /** Logs the welcome; returns an error message when some kinds are not run by this controller. */
  private logWelcome(w: Welcome): string | undefined {
    this.logger.info("capstan: connected to the controller", {
      connection: w.connectionId,
      runtime: `${w.runtime?.name ?? ""} ${w.runtime?.version ?? ""}`.trim(),
      max_in_flight: w.limits?.maxInFlight,
    });
    const unsupported: string[] = [];
    for (const st of w.registrations) {
      if (st.accepted) {
        for (const d of st.diagnostics) {
          this.logger.warn("capstan: handler registered with a warning", { handler: st.handlerId, reason: d.reason, summary: d.summary });
        }
        continue;
      }
      for (const d of st.diagnostics) {
        this.logger.warn("capstan: handler rejected", { handler: st.handlerId, reason: d.reason, field: d.field, summary: d.summary });
        if (d.reason === "UNSUPPORTED_HANDLER_KIND") unsupported.push(`${JSON.stringify(st.handlerId)} (${d.summary})`);
      }
    }
    return unsupported.length ? `capstan: the controller does not run these handlers' kinds: ${unsupported.join(", ")}` : undefined;
  }
}

interface StreamEnd {
  code: number;
  details: string;
  welcomed: boolean;
  /** How long the stream was up after its welcome, in milliseconds. */
  upMs: number;
  fatal?: string;
}

/** A running invocation. */
interface Running {
  ctx: Context;
  abort: LazyAbort;
  answered: boolean;
  timers: Timer[];
}

/**
 * One stream after its handshake. Every connection gets a new session, so results of
 * invocations of a lost stream never reach the next one.
 */
class Session {
  private readonly running = new Map<string, Running>();
  private readonly indexes: Indexes;
  private readonly capabilities: Set<number>;
  private closed = false;
  private lost = false;
  private idleWaiters: (() => void)[] = [];
  private endWaiters: (() => void)[] = [];
  private farewellWaiters: (() => void)[] = [];
  private farewellCame = false;
  private readonly cleanupOnGoodbye: boolean;
  private readonly sink: Sink;
  private readonly maxMessageBytes: number;
  /** Bytes handed to the stream and not yet flushed. */
  private pendingBytes = 0;
  private droppedForBuffer = 0;

  constructor(
    private readonly op: Operator,
    private readonly call: grpc.ClientDuplexStream<ConnectRequest, ConnectResponse>,
    welcome: Welcome,
  ) {
    this.indexes = new Indexes(op.registry.handlers.filter((h) => h.kind === "index").map((h) => h.id));
    this.capabilities = new Set(welcome.capabilities as number[]);
    this.cleanupOnGoodbye =
      this.capabilities.has(Capability.CLEANUP_ON_GOODBYE) && op.registry.handlers.some((h) => h.kind === "cleanup");
    const limit = Number(welcome.limits?.maxMessageBytes ?? 0n);
    this.maxMessageBytes = limit > 0 ? Math.min(limit, MAX_MESSAGE_BYTES) : MAX_MESSAGE_BYTES;
    this.sink = {
      log: (r: LogOut) => this.sendDroppable(() => logRequest(r), "log record", r.invocationId),
      update: (id, patches) => {
        if (!this.capabilities.has(Capability.INVOCATION_UPDATES)) {
          op.logger.warn("capstan: the controller takes no interim patches; dropped", { invocation: id });
          return;
        }
        this.sendDroppable(() => updateRequest(id, patches), "interim update", id);
      },
      local: op.logger,
    };
  }

  private get log(): Logger {
    return this.op.logger;
  }

  /** Sends one message, unless the stream has ended or our side is closed. */
  send(m: ConnectRequest): void {
    if (this.closed) return;
    try {
      this.call.write(m);
    } catch (error) {
      this.log.debug("capstan: send failed; the stream has ended", { error: String(error) });
      this.closed = true;
    }
  }

  /** Writes an encoded message, counting its bytes until it is flushed. */
  private sendBytes(bytes: Buffer): void {
    if (this.closed) return;
    const n = bytes.length;
    this.pendingBytes += n;
    try {
      // encodeRequest passes an encoded message through as it is.
      this.call.write(bytes as unknown as ConnectRequest, () => {
        this.pendingBytes -= n;
      });
    } catch (error) {
      this.pendingBytes -= n;
      this.log.debug("capstan: send failed; the stream has ended", { error: String(error) });
      this.closed = true;
    }
  }

  /**
   * Sends a log record or an interim update unless it cannot be encoded, exceeds the message
   * size limit, or the outgoing buffer is full (then it is dropped, and counted).
   */
  private sendDroppable(build: () => ConnectRequest, what: string, invocation: string): void {
    if (this.closed) return;
    if (this.pendingBytes > OUTGOING_BUFFER_LIMIT) {
      if (this.droppedForBuffer++ === 0) {
        this.log.warn("capstan: the outgoing buffer is full; dropping log records and interim updates", { invocation, limit: OUTGOING_BUFFER_LIMIT });
      }
      return;
    }
    let bytes: Buffer;
    try {
      bytes = encodeRequest(build());
    } catch (error) {
      this.log.warn(`capstan: dropping a ${what} that cannot be encoded`, { invocation, error: String(error) });
      return;
    }
    if (bytes.length > this.maxMessageBytes) {
      this.log.warn(`capstan: dropping a ${what} larger than the message size limit`, { invocation, bytes: bytes.length, limit: this.maxMessageBytes });
      return;
    }
    this.sendBytes(bytes);
  }

  /** How many log records and interim updates were dropped because the outgoing buffer was full. */
  get dropped(): number {
    return this.droppedForBuffer;
  }

  /**
   * Sends an invocation's result; one that cannot be encoded, or exceeds the message size
   * limit, is replaced by a permanent error (RESULT_NOT_ENCODABLE, RESULT_TOO_LARGE).
   */
  private sendResult(id: string, r: Running, out: InvocationOutcome): void {
    let bytes: Buffer;
    try {
      bytes = encodeRequest(resultRequest(id, out));
    } catch (error) {
      const summary = `the handler's result cannot be encoded: ${String(error)}`.slice(0, 1024);
      this.log.warn("capstan: the handler's result cannot be encoded; answering a permanent error", { handler: r.ctx.handlerId, invocation: id, error: String(error) });
      bytes = encodeRequest(rejection(id, "RESULT_NOT_ENCODABLE", summary));
    }
    if (bytes.length > this.maxMessageBytes) {
      const summary = `the handler's result is ${bytes.length} bytes encoded; the limit is ${this.maxMessageBytes}`;
      this.log.warn("capstan: the handler's result is too large; answering a permanent error", { handler: r.ctx.handlerId, invocation: id, bytes: bytes.length });
      bytes = encodeRequest(rejection(id, "RESULT_TOO_LARGE", summary));
    }
    this.sendBytes(bytes);
  }

  sendFlow(handlerId: string, maxInFlight: number): void {
    this.send(request({ message: { case: "flowControl", value: { handlerId, maxInFlight } } }));
  }

  /** The reader: never waits for user code. */
  receive(m: ConnectResponse): void {
    const msg = m.message;
    switch (msg.case) {
      case "invocation":
        this.start(msg.value);
        break;
      case "cancel":
        this.cancel(msg.value);
        break;
      case "ping":
        this.send(request({ message: { case: "pong", value: { nonce: msg.value.nonce, inFlight: this.running.size } } }));
        break;
      case "objectUpdate": {
        const r = this.running.get(msg.value.invocationId);
        if (!r) break; // finished already: ignored
        try {
          const body = decodeJson(msg.value.body);
          if (body && typeof body === "object" && !Array.isArray(body)) r.ctx.setBody(body as JsonObject);
          else this.log.warn("capstan: ignoring an object update without an object body", { invocation: msg.value.invocationId });
        } catch (error) {
          this.log.warn("capstan: ignoring an object update with malformed JSON", { invocation: msg.value.invocationId, error: String(error) });
        }
        break;
      }
      case "objectGone":
        if (msg.value.object?.uid) this.op.memos.drop(msg.value.object.uid);
        break;
      case "drain":
        this.log.info("capstan: the controller is draining; no new invocations will come", {
          reason: msg.value.reason,
          grace: msg.value.gracePeriod ? `${durationMs(msg.value.gracePeriod) / 1000}s` : undefined,
        });
        break;
      case "resultAck":
        if (!msg.value.accepted) {
          for (const d of msg.value.diagnostics) {
            this.log.warn("capstan: result not accepted", { invocation: msg.value.invocationId, reason: d.reason, summary: d.summary, field: d.field });
          }
        }
        break;
      case "notice":
        for (const d of msg.value.diagnostics) {
          this.log.warn("capstan: notice from the controller", { invocation: msg.value.invocationId, reason: d.reason, summary: d.summary, field: d.field });
        }
        break;
      case "farewell":
        this.log.info("capstan: the controller ran this process's cleanup", { reason: msg.value.reason });
        this.farewellCame = true;
        for (const w of this.farewellWaiters.splice(0)) w();
        break;
      case "welcome":
        this.log.warn("capstan: ignoring a second welcome");
        break;
      default:
        this.log.debug("capstan: ignoring a message this SDK does not know");
    }
  }

  private start(m: Invocation): void {
    const id = m.invocationId;
    const spec = this.op.registry.get(m.handlerId);
    if (!spec) {
      this.log.warn("capstan: rejecting an invocation of an unknown handler", { invocation: id, handler: m.handlerId });
      this.send(rejection(id, "UNKNOWN_HANDLER", `no handler ${JSON.stringify(m.handlerId)} is registered in this process`));
      return;
    }
    if (this.running.has(id)) {
      this.log.warn("capstan: ignoring a duplicate invocation", { invocation: id });
      return;
    }
    let data;
    try {
      data = invocationData(m, spec.kind);
    } catch (error) {
      this.send(rejection(id, "INVALID_INVOCATION", `the invocation carries malformed JSON: ${String(error)}`));
      return;
    }
    const abort = new LazyAbort();
    const ctx = new Context(data, abort, this.sink, this.op.memos, this.indexes);
    const r: Running = { ctx, abort, answered: false, timers: [] };
    this.running.set(id, r);
    if (data.deadline) {
      const ms = Math.max(data.deadline.getTime() - Date.now(), 0);
      r.timers.push(longTimeout(() => this.abortOne(r, "deadline_exceeded"), ms));
    }
    const begin = performance.now();
    execute(spec, ctx, this.indexes)
      .then(
        (out) => this.finish(id, r, { ...out, duration: (performance.now() - begin) / 1000 }),
        (error) =>
          this.finish(id, r, { outcome: classify(error, ctx.signal), patches: [], subhandlers: [], duration: (performance.now() - begin) / 1000 }),
      )
      .catch((error) => this.log.error("capstan: answering an invocation failed", { invocation: id, error: String(error) }));
  }

  private abortOne(r: Running, reason: CancelReason): void {
    if (r.abort.aborted) return;
    r.ctx.cancelReasonValue = reason;
    r.abort.abort(new CancelledError(reason));
  }

  /** Sends an invocation's one result (unless it was answered already or its stream is gone). */
  private finish(id: string, r: Running, out: InvocationOutcome): void {
    for (const t of r.timers) t.cancel();
    if (r.answered) return;
    r.answered = true;
    this.running.delete(id);
    if (out.outcome.status === "unclassified") {
      this.log.warn("capstan: handler failed", { handler: r.ctx.handlerId, invocation: id, error: out.outcome.message });
    }
    if (!this.lost) this.sendResult(id, r, out);
    this.forget(r, out);
    if (this.running.size === 0) for (const w of this.idleWaiters.splice(0)) w();
  }

  /** Drops the memo of an object that went away. */
  private forget(r: Running, out: InvocationOutcome): void {
    const uid = r.ctx.uid;
    if (!uid) return;
    if (r.ctx.type === "DELETED") this.op.memos.drop(uid);
    else if (r.ctx.kind === "delete" && out.outcome.status === "success") {
      setTimeout(() => this.op.memos.drop(uid), 60_000).unref();
    }
  }

  private cancel(c: Cancel): void {
    const r = this.running.get(c.invocationId);
    if (!r) return; // finished already: its result is on the way
    const reason = cancelReason(c.reason);
    this.abortOne(r, reason);
    if (reason === "resource_deleted" && r.ctx.uid) this.op.memos.drop(r.ctx.uid);
    // A handler that ignores its signal is still answered within the grace period. An unset
    // grace period means "wait as long as it takes" (kopf's daemons without a
    // cancellation_timeout): then only the handler answers.
    if (!c.gracePeriod) return;
    const grace = durationMs(c.gracePeriod);
    const margin = Math.max(grace - Math.max(100, grace * 0.1), 0);
    r.timers.push(
      longTimeout(() => {
        if (r.answered) return;
        this.log.warn("capstan: the handler ignored its cancellation; answering cancelled", { invocation: c.invocationId });
        this.finish(c.invocationId, r, { outcome: { status: "cancelled" }, patches: [], subhandlers: [], duration: 0 });
      }, margin),
    );
  }

  /** The stream ended: what still runs is dead (the controller redelivers it). */
  ended(code: number, details: string): void {
    this.closed = true;
    if (!this.op.stopping || code !== grpc.status.OK) {
      this.log.info("capstan: the stream ended", { code: grpc.status[code] ?? code, details });
    }
    this.lost = true;
    if (this.droppedForBuffer > 0) {
      this.log.warn("capstan: log records and interim updates dropped on a full outgoing buffer", { dropped: this.droppedForBuffer });
    }
    for (const r of this.running.values()) {
      this.abortOne(r, "stream_lost");
      r.answered = true;
      for (const t of r.timers) t.cancel();
    }
    this.running.clear();
    for (const w of this.idleWaiters.splice(0)) w();
    for (const w of this.endWaiters.splice(0)) w();
    for (const w of this.farewellWaiters.splice(0)) w();
  }

  private whenEnded(): Promise<void> {
    if (this.lost) return Promise.resolve();
    return new Promise((resolve) => this.endWaiters.push(resolve));
  }

  private whenIdle(): Promise<void> {
    if (this.running.size === 0) return Promise.resolve();
    return new Promise((resolve) => this.idleWaiters.push(resolve));
  }

  private whenFarewell(): Promise<void> {
    if (this.farewellCame) return Promise.resolve();
    return new Promise((resolve) => this.farewellWaiters.push(resolve));
  }

  /**
   * Says goodbye, lets running invocations finish within the grace period, cancels the rest
   * (still sending their results), and closes our side of the stream.
   */
  async shutdown(): Promise<void> {
    if (this.lost) return;
    const grace = (this.op.options.shutdownGrace ?? 10) * 1000;
    this.log.info("capstan: stopping; saying goodbye", { running: this.running.size, cleanup: this.cleanupOnGoodbye });
    this.send(request({ message: { case: "goodbye", value: { reason: "the handler process is stopping", cleanup: this.cleanupOnGoodbye } } }));
    const deadline = Date.now() + grace;
    if (this.cleanupOnGoodbye) {
      // The cleanup handlers come now, on this stream: nothing is cancelled before farewell.
      const timeout = (this.op.options.cleanupTimeout ?? 20) * 1000;
      const timedOut = await within(timeout, this.whenFarewell(), this.whenEnded());
      if (timedOut) this.log.warn("capstan: the controller did not finish this process's cleanup handlers in time");
    }
    if (this.lost) return;
    await within(Math.max(deadline - Date.now(), 0), this.whenIdle(), this.whenEnded());
    if (this.lost) return;
    if (this.running.size > 0) {
      this.log.warn("capstan: cancelling the invocations still running", { running: this.running.size });
      for (const r of this.running.values()) this.abortOne(r, "process_stopping");
      await within(Math.min(grace, 2000), this.whenIdle(), this.whenEnded());
      if (this.lost) return;
      for (const [id, r] of [...this.running]) {
        this.log.warn("capstan: the handler ignored its cancellation; answering cancelled", { invocation: id });
        this.finish(id, r, { outcome: { status: "cancelled" }, patches: [], subhandlers: [], duration: 0 });
      }
    }
    this.closed = true;
    this.call.end();
    await within(grace, this.whenEnded());
    if (!this.lost) this.call.cancel();
  }
}

/** Waits for the first of `promises`, or `ms`; true when the time ran out. The timer is cleared either way. */
async function within(ms: number, ...promises: Promise<unknown>[]): Promise<boolean> {
  let timer: Timer | undefined;
  const timeout = new Promise<boolean>((resolve) => {
    timer = longTimeout(() => resolve(true), ms);
  });
  try {
    return await Promise.race([timeout, ...promises.map((p) => p.then(() => false))]);
  } finally {
    timer?.cancel();
  }
}

/** A gRPC target for an endpoint: `unix:` endpoints as they are, `host:port` as TCP. */
export function target(endpoint: string): string {
  if (endpoint.startsWith("unix:")) return endpoint;
  if (endpoint.startsWith("/")) return `unix://${endpoint}`;
  return endpoint.replace(/^(tcp|http):\/\//, "");
}

/** The delay in seconds before reconnect attempt `failures + 1`: exponential, with jitter in its upper half. */
export function backoff(failures: number, lo = 0.25, hi = 30): number {
  const d = Math.min(hi, lo * 2 ** Math.min(failures, 30));
  return d / 2 + Math.random() * (d / 2);
}

/**
 * Whether every registration a NO_HANDLERS_ACCEPTED status names was rejected only because
 * another connection holds its id: then dialling again succeeds soon.
 */
export function onlyTaken(message: string): boolean {
  const open = message.indexOf("(");
  if (open < 0) return false;
  let list = message.slice(open + 1);
  if (list.endsWith(")")) list = list.slice(0, -1);
  let reasons = 0;
  for (const item of list.split("; ")) {
    const m = /\[([^\]]*)\]/.exec(item);
    if (!m) continue;
    for (const reason of m[1]!.split(",")) {
      if (reason.trim() !== "HANDLER_ID_TAKEN") return false;
      reasons++;
    }
  }
  return reasons > 0;
}

let current: Operator | undefined;

/**
 * kopf's `kopf.run()`: serves the default registry's handlers (or `registry`'s) until SIGTERM
 * or SIGINT, then stops gracefully. Resolves after a graceful stop; rejects with a
 * {@link SetupError} when it cannot go on.
 */
export async function run(options: RunOptions & { registry?: Registry } = {}): Promise<void> {
  const op = new Operator(options.registry ?? getDefaultRegistry(), options);
  current = op;
  try {
    await op.run();
  } finally {
    if (current === op) current = undefined;
  }
}

/** Caps in-flight invocations of the operator started by {@link run} (see {@link Operator.setMaxInFlight}). */
export function setMaxInFlight(handlerId: string | undefined, n: number): void {
  if (!current) throw new Error("capstan: no operator is running");
  current.setMaxInFlight(handlerId, n);
}

/** Stops the operator started by {@link run}. */
export function stop(): void {
  current?.stop();
}

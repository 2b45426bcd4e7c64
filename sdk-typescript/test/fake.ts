// The fake controller of the stream tests: a @grpc/grpc-js server on a Unix socket.

import * as grpc from "@grpc/grpc-js";
import { decodeRequest, encodeResponse, response } from "../src/wire";
import type { ConnectRequest, ConnectResponse } from "../src/wire";
import { Capability } from "../src/gen/capstan/v1/runtime_service_pb";

export type Call = grpc.ServerDuplexStream<ConnectRequest, ConnectResponse>;

/** One connection of the fake controller: what came in, and a way to wait for more. */
export class Conn {
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

export class FakeController {
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
  async handshake(n: number, capabilities: Capability[] = [Capability.RESULT_ACK, Capability.SUBHANDLERS, Capability.OBJECT_UPDATES], limits: Record<string, unknown> = {}) {
    const conn = await this.connection(n);
    const hello = await conn.next("hello");
    conn.send(
      response({
        message: {
          case: "welcome",
          value: {
            connectionId: String(n),
            capabilities,
            limits: { maxMessageBytes: 16n << 20n, maxInFlight: 256, ...limits },
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

export function invocation(id: string, handlerId: string, spec: unknown, extra: Record<string, unknown> = {}): ConnectResponse {
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

export const json = (j: { json: Uint8Array } | undefined) => (j ? JSON.parse(new TextDecoder().decode(j.json)) : undefined);

// Hand-written protobuf coding of the two messages on the hot path, an invocation in and its
// result out, with protobuf-es's BinaryReader and BinaryWriter. The reflective fromBinary and
// toBinary took a third of a no-op invocation's CPU; everything else, and anything unusual in
// these two (a field seen twice, a wire type that does not fit), still goes through them. Only
// wire.ts uses this file.

import { fromBinary } from "@bufbuild/protobuf";
import { BinaryReader, BinaryWriter, WireType } from "@bufbuild/protobuf/wire";
import { TimestampSchema } from "@bufbuild/protobuf/wkt";
import type { Duration } from "@bufbuild/protobuf/wkt";
import type { Json, Patch, ResourceRef } from "./gen/capstan/v1/common_pb";
import { DiagnosticSchema } from "./gen/capstan/v1/common_pb";
import type { Invocation, ResourceChange } from "./gen/capstan/v1/invocation_pb";
import {
  ActivityRequestSchema,
  AdmissionRequestSchema,
  DaemonStartSchema,
  DiffItemSchema,
  IndexRequestSchema,
  ProbeRequestSchema,
  ResourceEventSchema,
  SubhandlerStateSchema,
  TimerTickSchema,
} from "./gen/capstan/v1/invocation_pb";
import type { ConnectResponse } from "./gen/capstan/v1/runtime_service_pb";

/** Thrown inside the fast decoder: the message is left to the reflective one. */
class Unusual extends Error {}
const UNUSUAL = new Unusual();

function expect(actual: WireType, wanted: WireType): void {
  if (actual !== wanted) throw UNUSUAL;
}

function json(r: BinaryReader): Json {
  const end = r.uint32() + r.pos;
  let bytes: Uint8Array = new Uint8Array(0);
  while (r.pos < end) {
    const [no, wt] = r.tag();
    if (no === 1) {
      expect(wt, WireType.LengthDelimited);
      bytes = r.bytes();
    } else r.skip(wt, no);
  }
  if (r.pos !== end) throw UNUSUAL;
  return { $typeName: "capstan.v1.Json", json: bytes } as Json;
}

function resourceRef(r: BinaryReader): ResourceRef {
  const end = r.uint32() + r.pos;
  const ref = {
    $typeName: "capstan.v1.ResourceRef",
    group: "",
    version: "",
    kind: "",
    plural: "",
    namespace: "",
    name: "",
    uid: "",
    resourceVersion: "",
    generation: BigInt(0),
  } as ResourceRef;
  while (r.pos < end) {
    const [no, wt] = r.tag();
    if (no >= 1 && no <= 8) expect(wt, WireType.LengthDelimited);
    switch (no) {
      case 1: ref.group = r.string(true); break;
      case 2: ref.version = r.string(true); break;
      case 3: ref.kind = r.string(true); break;
      case 4: ref.plural = r.string(true); break;
      case 5: ref.namespace = r.string(true); break;
      case 6: ref.name = r.string(true); break;
      case 7: ref.uid = r.string(true); break;
      case 8: ref.resourceVersion = r.string(true); break;
      case 9:
        expect(wt, WireType.Varint);
        ref.generation = BigInt(r.int64());
        break;
      default:
        r.skip(wt, no);
    }
  }
  if (r.pos !== end) throw UNUSUAL;
  return ref;
}

function change(r: BinaryReader): ResourceChange {
  const end = r.uint32() + r.pos;
  const c = { $typeName: "capstan.v1.ResourceChange", reason: 0, diff: [], field: "" } as unknown as ResourceChange;
  while (r.pos < end) {
    const [no, wt] = r.tag();
    switch (no) {
      case 1:
        expect(wt, WireType.Varint);
        c.reason = r.int32();
        break;
      case 2:
        expect(wt, WireType.LengthDelimited);
        if (c.old) throw UNUSUAL;
        c.old = json(r);
        break;
      case 3:
        expect(wt, WireType.LengthDelimited);
        if (c.new) throw UNUSUAL;
        c.new = json(r);
        break;
      case 4:
        expect(wt, WireType.LengthDelimited);
        c.diff.push(fromBinary(DiffItemSchema, r.bytes()));
        break;
      case 5:
        expect(wt, WireType.LengthDelimited);
        c.field = r.string(true);
        break;
      default:
        r.skip(wt, no);
    }
  }
  if (r.pos !== end) throw UNUSUAL;
  return c;
}

function mapEntry(r: BinaryReader, into: Record<string, string>): void {
  const end = r.uint32() + r.pos;
  let key = "";
  let value = "";
  while (r.pos < end) {
    const [no, wt] = r.tag();
    if (no === 1 || no === 2) {
      expect(wt, WireType.LengthDelimited);
      if (no === 1) key = r.string(true);
      else value = r.string(true);
    } else r.skip(wt, no);
  }
  if (r.pos !== end) throw UNUSUAL;
  into[key] = value;
}

const PAYLOADS = {
  21: ["event", ResourceEventSchema],
  22: ["daemon", DaemonStartSchema],
  23: ["timer", TimerTickSchema],
  24: ["index", IndexRequestSchema],
  25: ["admission", AdmissionRequestSchema],
  26: ["probe", ProbeRequestSchema],
  27: ["activity", ActivityRequestSchema],
} as const;

function invocation(r: BinaryReader, end: number): Invocation {
  const m = {
    $typeName: "capstan.v1.Invocation",
    invocationId: "",
    handlerId: "",
    attempt: 0,
    idempotencyKey: "",
    traceContext: {},
    subhandlers: [],
    payload: { case: undefined },
  } as unknown as Invocation;
  while (r.pos < end) {
    const [no, wt] = r.tag();
    if (no !== 3) expect(wt, WireType.LengthDelimited);
    switch (no) {
      case 1: m.invocationId = r.string(true); break;
      case 2: m.handlerId = r.string(true); break;
      case 3:
        expect(wt, WireType.Varint);
        m.attempt = r.uint32();
        break;
      case 4: m.idempotencyKey = r.string(true); break;
      case 5:
        if (m.deadline) throw UNUSUAL;
        m.deadline = fromBinary(TimestampSchema, r.bytes());
        break;
      case 6:
        if (m.startedTime) throw UNUSUAL;
        m.startedTime = fromBinary(TimestampSchema, r.bytes());
        break;
      case 7:
        if (m.resource) throw UNUSUAL;
        m.resource = resourceRef(r);
        break;
      case 8:
        if (m.body) throw UNUSUAL;
        m.body = json(r);
        break;
      case 9: mapEntry(r, m.traceContext); break;
      case 10:
        if (m.lastError) throw UNUSUAL;
        m.lastError = fromBinary(DiagnosticSchema, r.bytes());
        break;
      case 11:
        if (m.param) throw UNUSUAL;
        m.param = json(r);
        break;
      case 12: m.subhandlers.push(fromBinary(SubhandlerStateSchema, r.bytes())); break;
      case 20:
        if (m.payload.case !== undefined) throw UNUSUAL;
        m.payload = { case: "change", value: change(r) };
        break;
      default: {
        const p = PAYLOADS[no as keyof typeof PAYLOADS];
        if (!p) {
          r.skip(wt, no);
          break;
        }
        if (m.payload.case !== undefined) throw UNUSUAL;
        m.payload = { case: p[0], value: fromBinary(p[1], r.bytes()) } as Invocation["payload"];
      }
    }
  }
  if (r.pos !== end) throw UNUSUAL;
  return m;
}

/**
 * A ConnectResponse that carries an invocation and nothing else, decoded by hand; undefined for
 * every other message (and anything unusual), which the reflective decoder then reads.
 */
export function fastInvocationResponse(b: Uint8Array): ConnectResponse | undefined {
  try {
    const r = new BinaryReader(b);
    const [no, wt] = r.tag();
    if (no !== 2 || wt !== WireType.LengthDelimited) return undefined;
    const end = r.uint32() + r.pos;
    if (end !== b.length) return undefined;
    const value = invocation(r, end);
    return { $typeName: "capstan.v1.ConnectResponse", message: { case: "invocation", value } } as ConnectResponse;
  } catch {
    return undefined;
  }
}

/**
 * The bytes of a ConnectRequest with a successful InvocationResult that has no sub-handlers and
 * no kind result: the invocation id, the result's JSON (if any), the patches and the duration,
 * as toBinary writes them.
 */
export function encodeSuccessResult(invocationId: string, result: Json | undefined, patches: readonly Patch[], duration: Duration): Uint8Array {
  const w = new BinaryWriter();
  w.tag(2, WireType.LengthDelimited).fork(); // ConnectRequest.result
  if (invocationId) w.tag(1, WireType.LengthDelimited).string(invocationId);
  w.tag(2, WireType.LengthDelimited).fork(); // InvocationResult.success
  if (result) jsonField(w, 1, result);
  w.join();
  for (const p of patches) {
    w.tag(10, WireType.LengthDelimited).fork();
    if (p.type) w.tag(1, WireType.Varint).int32(p.type);
    if (p.target) w.tag(2, WireType.Varint).int32(p.target);
    if (p.body) jsonField(w, 3, p.body);
    w.join();
  }
  w.tag(11, WireType.LengthDelimited).fork(); // google.protobuf.Duration
  if (duration.seconds) w.tag(1, WireType.Varint).int64(duration.seconds);
  if (duration.nanos) w.tag(2, WireType.Varint).int32(duration.nanos);
  w.join();
  w.join();
  return w.finish();
}

function jsonField(w: BinaryWriter, no: number, j: Json): void {
  w.tag(no, WireType.LengthDelimited).fork();
  if (j.json.byteLength) w.tag(1, WireType.LengthDelimited).bytes(j.json);
  w.join();
}

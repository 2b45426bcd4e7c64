// kopf's `patch`: the changes a handler makes to its object, as a JSON merge patch.

import type { JsonObject, PatchDocument } from "./types";

function isObject(v: unknown): v is JsonObject {
  return typeof v === "object" && v !== null && !Array.isArray(v);
}

/** Deep-merges `source` into `target` (RFC 7386 style, but keeping `null`s as deletions). */
export function mergeInto(target: JsonObject, source: JsonObject): JsonObject {
  for (const [key, value] of Object.entries(source)) {
    if (isObject(value)) {
      const existing = target[key];
      const node: JsonObject = isObject(existing) ? existing : {};
      target[key] = mergeInto(node, value);
    } else {
      target[key] = clone(value);
    }
  }
  return target;
}

function clone<T>(v: T): T {
  return v === undefined ? v : (JSON.parse(JSON.stringify(v)) as T);
}

/** Drops empty objects (sections read but never written) from a merge patch. */
function prune(doc: JsonObject): JsonObject {
  const out: JsonObject = {};
  for (const [key, value] of Object.entries(doc)) {
    if (value === undefined) continue;
    if (isObject(value)) {
      const inner = prune(value);
      if (Object.keys(inner).length === 0) continue;
      out[key] = inner;
    } else {
      out[key] = value;
    }
  }
  return out;
}

/**
 * The changes a handler makes to its object (kopf's `patch`): an RFC 7386 JSON merge patch,
 * sent with a successful result and discarded otherwise. `null` deletes a key. What is under
 * `status` is sent to the status subresource.
 *
 * ```ts
 * patch.metadata.labels = { ...patch.metadata.labels, ready: "yes" }; // or patch.label("ready", "yes")
 * patch.status.phase = "Ready";
 * patch.merge({ spec: { replicas: 3 } });
 * ```
 */
export class Patch {
  private doc: JsonObject = {};

  /** The whole merge patch document (object and status parts). */
  get document(): JsonObject {
    return this.doc;
  }

  private section(key: string): JsonObject {
    const v = this.doc[key];
    if (isObject(v)) return v;
    const fresh: JsonObject = {};
    this.doc[key] = fresh;
    return fresh;
  }

  /** `metadata` of the patch; created on first use. */
  get metadata(): JsonObject {
    return this.section("metadata");
  }
  /** `spec` of the patch; created on first use. */
  get spec(): JsonObject {
    return this.section("spec");
  }
  /** `status` of the patch (sent to the status subresource); created on first use. */
  get status(): JsonObject {
    return this.section("status");
  }

  /** Merges a merge-patch document into the patch, deep for nested objects (kopf's `patch.update`). */
  merge(doc: JsonObject): this {
    if (!isObject(doc)) throw new TypeError("a merge patch must be a JSON object");
    mergeInto(this.doc, doc);
    return this;
  }

  /** Sets the value at a path (`["spec", "size"]` or `"spec.size"`); `null` deletes the key. */
  set(path: string | readonly string[], value: unknown): this {
    const keys = typeof path === "string" ? path.split(".") : [...path];
    if (keys.length === 0) return this;
    let node = this.doc;
    for (const key of keys.slice(0, -1)) {
      const next = node[key];
      if (isObject(next)) node = next;
      else {
        const fresh: JsonObject = {};
        node[key] = fresh;
        node = fresh;
      }
    }
    node[keys[keys.length - 1]!] = clone(value);
    return this;
  }

  /** Sets a label (`null` removes it). */
  label(key: string, value: string | null): this {
    return this.set(["metadata", "labels", key], value);
  }

  /** Sets an annotation (`null` removes it). */
  annotation(key: string, value: string | null): this {
    return this.set(["metadata", "annotations", key], value);
  }

  /** True when the patch changes nothing. */
  isEmpty(): boolean {
    return Object.keys(prune(this.doc)).length === 0;
  }

  /** Forgets every change. */
  clear(): void {
    this.doc = {};
  }

  /**
   * The patch as documents for the controller: one merge patch of the object (all but
   * `status`) and one of the status subresource (`{"status": …}`), each only when non-empty.
   * With `splitStatus: false` (admission) everything is one merge patch of the object.
   */
  toDocuments(splitStatus = true): PatchDocument[] {
    const doc = prune(this.doc);
    if (!splitStatus) {
      return Object.keys(doc).length ? [{ type: "merge", target: "object", body: doc }] : [];
    }
    const out: PatchDocument[] = [];
    const { status, ...rest } = doc;
    if (Object.keys(rest).length) out.push({ type: "merge", target: "object", body: rest });
    if (status !== undefined) out.push({ type: "merge", target: "status", body: { status } });
    return out;
  }
}

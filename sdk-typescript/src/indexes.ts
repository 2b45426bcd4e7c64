// kopf's indexes: in-memory maps built by index handlers, read by every other handler.

/** The `None` key of kopf: where a non-object index value goes. */
export const NONE_KEY: unique symbol = Symbol("None");

/** An index key: a JSON object key, or {@link NONE_KEY}. */
export type IndexKey = string | typeof NONE_KEY;

/** How an index identifies an object: namespace, name and uid. */
export interface ObjectKey {
  namespace: string;
  name: string;
  uid: string;
}

function objectId(o: ObjectKey): string {
  return `${o.namespace}\u0000${o.name}\u0000${o.uid}`;
}

/**
 * One index (kopf's `kopf.Index`): each key maps to its store, the values under that key from
 * all objects. Read-only for handlers.
 */
export class Index {
  // key -> object id -> value
  private readonly stores = new Map<IndexKey, Map<string, unknown>>();
  // object id -> keys it has entries under
  private readonly keysOf = new Map<string, IndexKey[]>();
  // uid -> object id (objects deleted while away are identified by uid only)
  private readonly byUid = new Map<string, string>();

  constructor(readonly name: string) {}

  /** The values under `key` (an empty list when there are none). */
  get(key: IndexKey): unknown[] {
    const store = this.stores.get(key);
    return store ? [...store.values()] : [];
  }

  has(key: IndexKey): boolean {
    return this.stores.has(key);
  }

  keys(): IndexKey[] {
    return [...this.stores.keys()];
  }

  get size(): number {
    return this.stores.size;
  }

  /** The index as a plain object (the None key as `null`'s string form is left out). */
  toObject(): Record<string, unknown[]> {
    const out: Record<string, unknown[]> = {};
    for (const key of this.stores.keys()) if (typeof key === "string") out[key] = this.get(key);
    return out;
  }

  /**
   * Folds an index handler's value for an object in (kopf's rules): an object puts each of its
   * keys with its value; any other non-null value goes under the None key; `null` or
   * `undefined` changes nothing.
   */
  fold(object: ObjectKey, value: unknown): void {
    if (value === null || value === undefined) return;
    this.drop(object);
    const id = objectId(object);
    const entries: [IndexKey, unknown][] =
      typeof value === "object" && !Array.isArray(value)
        ? Object.entries(value as Record<string, unknown>)
        : [[NONE_KEY, value]];
    const keys: IndexKey[] = [];
    for (const [key, v] of entries) {
      let store = this.stores.get(key);
      if (!store) this.stores.set(key, (store = new Map()));
      store.set(id, v);
      keys.push(key);
    }
    this.keysOf.set(id, keys);
    if (object.uid) this.byUid.set(object.uid, id);
  }

  /** Removes every entry of an object (found by its uid when only the uid is known). */
  drop(object: ObjectKey): void {
    let id = objectId(object);
    if (!this.keysOf.has(id) && object.uid) id = this.byUid.get(object.uid) ?? id;
    const keys = this.keysOf.get(id);
    if (!keys) return;
    for (const key of keys) {
      const store = this.stores.get(key);
      if (!store) continue;
      store.delete(id);
      if (store.size === 0) this.stores.delete(key);
    }
    this.keysOf.delete(id);
    if (object.uid) this.byUid.delete(object.uid);
  }
}

/** The indexes of one connection, by index handler id. */
export class Indexes {
  private readonly byName = new Map<string, Index>();
  constructor(names: Iterable<string>) {
    for (const name of names) this.byName.set(name, new Index(name));
  }
  get(name: string): Index | undefined {
    return this.byName.get(name);
  }
  names(): string[] {
    return [...this.byName.keys()];
  }
}

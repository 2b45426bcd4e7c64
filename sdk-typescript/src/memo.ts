// kopf's `memo`: per-object state kept in this process between calls.

/** A memo: any values a handler keeps for an object (or the operator, for activities). */
export type Memo = Record<string, any>;

/** The most objects whose memos are kept; beyond it the least recently used is dropped. */
export const MAX_MEMOS = 65536;

/** The memos of objects, by uid, each a shallow copy of the operator-wide memo at first use. */
export class Memos {
  private readonly byUid = new Map<string, Memo>();
  constructor(
    readonly operator: Memo = {},
    private readonly max = MAX_MEMOS,
  ) {}

  /** The memo of the object with this uid (the operator's memo for an empty uid). */
  get(uid: string): Memo {
    if (!uid) return this.operator;
    let memo = this.byUid.get(uid);
    if (memo) {
      this.byUid.delete(uid); // most recently used goes last
    } else {
      memo = { ...this.operator };
    }
    this.byUid.set(uid, memo);
    while (this.byUid.size > this.max) {
      const oldest = this.byUid.keys().next().value as string;
      this.byUid.delete(oldest);
    }
    return memo;
  }

  /** Drops the memo of an object that went away. */
  drop(uid: string): void {
    this.byUid.delete(uid);
  }

  has(uid: string): boolean {
    return this.byUid.has(uid);
  }

  get size(): number {
    return this.byUid.size;
  }
}

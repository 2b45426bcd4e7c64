// Timers that never fire early.

/** A pending {@link longTimeout}. */
export interface Timer {
  cancel(): void;
}

/** Node's longest timer delay; longer delays would fire after 1 ms. */
const MAX_TIMER_MS = 2 ** 31 - 1;

/** setTimeout that never fires early: delays past Node's 2^31-1 ms limit are re-armed in chunks. */
export function longTimeout(fn: () => void, ms: number): Timer {
  let handle: NodeJS.Timeout | undefined;
  const due = Date.now() + Math.max(ms, 0);
  const arm = (left: number) => {
    handle = setTimeout(() => {
      const rest = due - Date.now();
      if (rest > 0) arm(rest);
      else fn();
    }, Math.min(Math.max(left, 0), MAX_TIMER_MS));
  };
  arm(Math.max(ms, 0));
  return {
    cancel: () => {
      if (handle) clearTimeout(handle);
      handle = undefined;
    },
  };
}

// kopf's error classes: how a handler says how it failed.

/** Options of a {@link TemporaryError}. */
export interface TemporaryErrorOptions {
  /** Seconds to wait before the next attempt; unset: the registration's backoff. */
  delay?: number;
}

/**
 * kopf's `TemporaryError`: the handler failed, and should be retried after `delay` seconds (or
 * after the registration's backoff when no delay is given).
 */
export class TemporaryError extends Error {
  readonly delay: number | undefined;
  constructor(message: string, options: TemporaryErrorOptions = {}) {
    super(message);
    this.name = "TemporaryError";
    this.delay = options.delay;
  }
}

/** kopf's `PermanentError`: the handler failed for good; it is not retried until the next change. */
export class PermanentError extends Error {
  constructor(message: string) {
    super(message);
    this.name = "PermanentError";
  }
}

/**
 * kopf's `AdmissionError`: thrown by a validating or mutating handler, it denies the request
 * with `message` and the HTTP status `code` (500 unless given, as kopf).
 */
export class AdmissionError extends PermanentError {
  readonly code: number;
  constructor(message: string, code = 500) {
    super(message);
    this.name = "AdmissionError";
    this.code = code;
  }
}

/**
 * Thrown by {@link Operator.run} when the controller accepted no handler, or does not run some
 * kinds; by a registration or `setMaxInFlight` given a value out of the protocol's range.
 */
export class SetupError extends Error {
  constructor(message: string) {
    super(message);
    this.name = "SetupError";
  }
}

/** Why an invocation was cancelled. */
export type CancelReason =
  | "resource_deleted"
  | "filter_mismatch"
  | "deadline_exceeded"
  | "superseded"
  | "runtime_shutdown"
  | "handler_unregistered"
  | "paused"
  | "stream_lost"
  | "process_stopping"
  | "unspecified";

/**
 * The reason of a handler's `signal` when it is aborted: the controller cancelled the
 * invocation, its deadline passed, the stream was lost, or the process is stopping. A handler
 * that throws after its signal was aborted ends `cancelled`.
 */
export class CancelledError extends Error {
  readonly reason: CancelReason;
  constructor(reason: CancelReason) {
    super(`the invocation was cancelled (${reason})`);
    this.name = "CancelledError";
    this.reason = reason;
  }
}

// The Capstan TypeScript SDK: kopf's vocabulary over the capstan.v1 protocol.

export { on, daemon, timer, index, Registry, getDefaultRegistry, setDefaultRegistry } from "./registry";
export type {
  HandlerFn,
  WhenFn,
  BaseOptions,
  FilterOptions,
  ResourceOptions,
  DeleteOptions,
  ResumeOptions,
  DaemonOptions,
  TimerOptions,
  AdmissionOptions,
  ActivityOptions,
  SubhandlerOptions,
  HandlerSpec,
} from "./registry";
export { Context, sleep } from "./context";
export type { HandlerLogger } from "./context";
export { Patch } from "./patch";
export { TemporaryError, PermanentError, AdmissionError, CancelledError } from "./errors";
export type { TemporaryErrorOptions, CancelReason } from "./errors";
export { Index, NONE_KEY } from "./indexes";
export type { IndexKey } from "./indexes";
export type { Memo } from "./memo";
export { stderrLogger, silentLogger } from "./logger";
export type { Logger } from "./logger";
export { Operator, run, stop, setMaxInFlight, SetupError, DEFAULT_ENDPOINT, SDK_NAME, SDK_VERSION, MAX_MESSAGE_BYTES } from "./runtime";
export type { RunOptions } from "./runtime";
export { PRESENT, ABSENT } from "./types";
export type {
  JsonObject,
  Kind,
  Reason,
  EventType,
  Operation,
  LogLevel,
  ErrorsMode,
  DiffOperation,
  DiffItem,
  Diff,
  ResourceSpec,
  ResourceRef,
  Diagnostic,
  MetaFilter,
  Credentials,
  AdmissionRequest,
  AdmissionVerdict,
  PatchDocument,
  SubhandlerState,
  Outcome,
  SubhandlerOutcome,
  InvocationOutcome,
} from "./types";

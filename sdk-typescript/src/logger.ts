// The SDK's local log (standard error), separate from the records sent to the controller.

/** Where the SDK writes its own log. */
export interface Logger {
  debug(message: string, fields?: Record<string, unknown>): void;
  info(message: string, fields?: Record<string, unknown>): void;
  warn(message: string, fields?: Record<string, unknown>): void;
  error(message: string, fields?: Record<string, unknown>): void;
}

const ORDER = { debug: 0, info: 1, warn: 2, error: 3 } as const;

/**
 * A logger writing one line per record to standard error, from `level` up (default: the
 * `CAPSTAN_LOG_LEVEL` environment variable, else `info`).
 */
export function stderrLogger(level?: keyof typeof ORDER): Logger {
  const env = process.env.CAPSTAN_LOG_LEVEL as keyof typeof ORDER | undefined;
  const min = ORDER[level ?? (env && env in ORDER ? env : "info")];
  const write = (lvl: keyof typeof ORDER) => (message: string, fields?: Record<string, unknown>) => {
    if (ORDER[lvl] < min) return;
    let line = `${new Date().toISOString()} ${lvl.toUpperCase()} ${message}`;
    if (fields) {
      for (const [k, v] of Object.entries(fields)) {
        if (v === undefined || v === "") continue;
        line += ` ${k}=${typeof v === "string" ? JSON.stringify(v) : safe(v)}`;
      }
    }
    process.stderr.write(line + "\n");
  };
  return { debug: write("debug"), info: write("info"), warn: write("warn"), error: write("error") };
}

function safe(v: unknown): string {
  try {
    return JSON.stringify(v) ?? String(v);
  } catch {
    return String(v);
  }
}

/** A logger that writes nothing. */
export const silentLogger: Logger = { debug() {}, info() {}, warn() {}, error() {} };

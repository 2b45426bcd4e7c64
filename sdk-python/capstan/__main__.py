"""`python -m capstan run FILE... [-m MODULE]...`: kopf run's habits for a handler process.

kopf run's options are all taken. The files, modules and logging options are this process's;
the rest (`-A`, `-n`, `--standalone`, `--dev`, `-L`, `-P`, `-p`) are the controller's flags:
with `--with-controller` this process starts the controller itself with them (for a laptop:
one command, as `kopf run` is), otherwise they are named once for the controller's command
line. `--kopf-compat` makes `import kopf` resolve to `capstan.kopf` in this process, so that a
kopf operator file runs unchanged.
"""

import argparse
import logging
import signal
import sys
import threading

from capstan.errors import RegistrationError
from capstan.registry import get_default_registry
from capstan.runner import configure_logging, load, run

log = logging.getLogger("capstan")


def _parser():
    parser = argparse.ArgumentParser(prog="python -m capstan", description="Run a Capstan handler process.")
    commands = parser.add_subparsers(dest="command", required=True)
    r = commands.add_parser("run", help="serve the handlers of the given files and modules")
    r.add_argument("paths", nargs="*", help="Python files with handlers")
    r.add_argument("-m", "--module", dest="modules", action="append", default=[], help="a module with handlers")
    r.add_argument("--endpoint", default=None, help="the controller's address (default: $CAPSTAN_ENDPOINT, "
                   "else unix:///run/capstan/capstan.sock)")
    r.add_argument("-v", "--verbose", action="store_true", help="log debug messages")
    r.add_argument("-d", "--debug", action="store_true", help="log debug messages, including gRPC's")
    r.add_argument("-q", "--quiet", action="store_true", help="log warnings and errors only")
    r.add_argument("--log-format", choices=["plain", "full", "json"], default="full", type=str.lower)
    r.add_argument("--log-refkey", help="kopf's; accepted (JSON logs name the object as `object`)")
    r.add_argument("--log-prefix", dest="log_prefix", action="store_true", default=None, help="kopf's; accepted")
    r.add_argument("--no-log-prefix", dest="log_prefix", action="store_false", help="kopf's; accepted")
    flags = r.add_argument_group("kopf run's options that are the controller's flags")
    flags.add_argument("-A", "--all-namespaces", dest="clusterwide", action="store_true")
    flags.add_argument("-n", "--namespace", dest="namespaces", action="append", default=[])
    flags.add_argument("--standalone", action="store_true", default=None)
    flags.add_argument("--dev", action="store_true")
    flags.add_argument("-L", "--liveness", dest="liveness_endpoint")
    flags.add_argument("-P", "--peering", dest="peering_name")
    flags.add_argument("-p", "--priority", type=int)
    r.add_argument("--with-controller", action="store_true",
                   help="start the controller too ($CAPSTAN_BINARY, else capstan on PATH) against the current "
                        "kubeconfig, with the options above as its flags")
    r.add_argument("--kopf-compat", action="store_true",
                   help="make `import kopf` resolve to capstan.kopf, so that kopf operator files run unchanged")
    return parser


def kopf_compat():
    """`import kopf` (and `kopf.on`, `kopf.testing`) resolve to `capstan.kopf` from now on, in
    this process."""
    import capstan.kopf
    import capstan.kopf.testing
    import capstan.on

    sys.modules["kopf"] = capstan.kopf
    sys.modules["kopf.on"] = capstan.on
    sys.modules["kopf.testing"] = capstan.kopf.testing


def main(argv=None):
    parser = _parser()
    args = parser.parse_args(argv)
    configure_logging(args.verbose, args.debug, args.quiet, args.log_format)
    if not args.paths and not args.modules:
        parser.error("give at least one file or -m module")
    from capstan.kopf import cli

    options = cli.RunOptions(paths=args.paths, modules=args.modules, clusterwide=args.clusterwide,
                             namespaces=args.namespaces, standalone=args.standalone, dev=args.dev,
                             liveness_endpoint=args.liveness_endpoint, peering_name=args.peering_name,
                             priority=args.priority)
    flags = cli.controller_flags(options)
    if flags and not args.with_controller:
        log.info("these options are the controller's flags, give them to `capstan run`: %s", " ".join(flags))
    if args.kopf_compat:
        kopf_compat()
    try:
        load(args.paths, args.modules)
        get_default_registry().check()
    except RegistrationError as error:
        log.error("%s", error)
        return 2
    if not args.with_controller:
        run(endpoint=args.endpoint)
        return 0
    return _with_controller(flags)


def _with_controller(flags):
    """Runs the controller beside this process. On SIGTERM or SIGINT the controller stops
    first — it runs the cleanup handlers through this process — then this process."""
    from capstan.controller import ControllerError, LocalController

    controller = LocalController(flags)
    stopping = threading.Event()

    def stop_controller_first(signum, frame):
        if stopping.is_set():
            return
        stopping.set()
        threading.Thread(target=_stop_both, args=(controller,), name="capstan-stop", daemon=True).start()

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, stop_controller_first)
    try:
        controller.start()
    except ControllerError as error:
        if stopping.is_set():
            return 0
        log.error("%s", error)
        return 1
    log.info("controller started at %s", controller.endpoint)
    try:
        if not stopping.is_set():
            run(endpoint=controller.endpoint, signals=False)
    finally:
        controller.stop()
    return 0


def _stop_both(controller):
    controller.stop()
    from capstan import runner

    runner.stop_all()


if __name__ == "__main__":
    sys.exit(main())

"""`python -m capstan run handlers.py [-m module]`: kopf run's habits for a handler process."""

import argparse
import logging
import sys

from capstan.errors import RegistrationError
from capstan.registry import get_default_registry
from capstan.runner import configure_logging, load, run


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m capstan", description="Run a Capstan handler process.")
    commands = parser.add_subparsers(dest="command", required=True)
    r = commands.add_parser("run", help="serve the handlers of the given files and modules")
    r.add_argument("paths", nargs="*", help="Python files with handlers")
    r.add_argument("-m", "--module", dest="modules", action="append", default=[], help="a module with handlers")
    r.add_argument("--endpoint", default=None, help="the controller's address (default: $CAPSTAN_ENDPOINT, "
                   "else unix:///run/capstan/capstan.sock)")
    r.add_argument("--verbose", action="store_true", help="log debug messages")
    r.add_argument("--debug", action="store_true", help="log debug messages, including gRPC's")
    r.add_argument("--quiet", action="store_true", help="log warnings and errors only")
    r.add_argument("--log-format", choices=["plain", "full", "json"], default="full")
    args = parser.parse_args(argv)
    configure_logging(args.verbose, args.debug, args.quiet, args.log_format)
    if not args.paths and not args.modules:
        parser.error("give at least one file or -m module")
    try:
        load(args.paths, args.modules)
        get_default_registry().check()
    except RegistrationError as error:
        logging.getLogger("capstan").error("%s", error)
        return 2
    run(endpoint=args.endpoint)
    return 0


if __name__ == "__main__":
    sys.exit(main())

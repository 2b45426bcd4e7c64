"""kopf's command line (`kopf run [OPTIONS] [PATHS]...`) read as kopf reads it, and mapped:
the handler process takes the files, modules and logging options; the controller takes the
rest as its flags (`controller_flags`)."""

import argparse
import dataclasses
from typing import List, Optional


class UsageError(Exception):
    """The arguments are not kopf's."""


class _Parser(argparse.ArgumentParser):
    def error(self, message):
        raise UsageError(message)


def _parser():
    p = _Parser(prog="kopf", add_help=False)
    commands = p.add_subparsers(dest="command", required=True)
    r = commands.add_parser("run", add_help=False)
    r.add_argument("-A", "--all-namespaces", dest="clusterwide", action="store_true")
    r.add_argument("-n", "--namespace", dest="namespaces", action="append", default=[])
    r.add_argument("--standalone", action="store_true", default=None)
    r.add_argument("--dev", action="store_true")
    r.add_argument("-L", "--liveness", dest="liveness_endpoint")
    r.add_argument("-P", "--peering", dest="peering_name")
    r.add_argument("-p", "--priority", type=int)
    r.add_argument("-m", "--module", dest="modules", action="append", default=[])
    r.add_argument("-v", "--verbose", action="store_true")
    r.add_argument("-d", "--debug", action="store_true")
    r.add_argument("-q", "--quiet", action="store_true")
    r.add_argument("--log-format", default="full", type=str.lower, choices=["plain", "full", "json"])
    r.add_argument("--log-refkey")
    r.add_argument("--log-prefix", dest="log_prefix", action="store_true", default=None)
    r.add_argument("--no-log-prefix", dest="log_prefix", action="store_false")
    r.add_argument("paths", nargs="*")
    return p


@dataclasses.dataclass
class RunOptions:
    """`kopf run`'s options."""

    paths: List[str]
    modules: List[str]
    clusterwide: bool = False
    namespaces: List[str] = dataclasses.field(default_factory=list)
    standalone: Optional[bool] = None
    dev: bool = False
    liveness_endpoint: Optional[str] = None
    peering_name: Optional[str] = None
    priority: Optional[int] = None
    verbose: bool = False
    debug: bool = False
    quiet: bool = False
    log_format: str = "full"


def parse(argv) -> RunOptions:
    """Reads `['run', ...]` as kopf does."""
    args = _parser().parse_args(list(argv))
    if not args.paths and not args.modules:
        raise UsageError("give at least one file or -m module")
    return RunOptions(paths=args.paths, modules=args.modules, clusterwide=args.clusterwide, namespaces=args.namespaces,
                      standalone=args.standalone, dev=args.dev, liveness_endpoint=args.liveness_endpoint,
                      peering_name=args.peering_name, priority=args.priority, verbose=args.verbose, debug=args.debug,
                      quiet=args.quiet, log_format=args.log_format)


def controller_flags(options: RunOptions) -> List[str]:
    """The controller's flags for kopf's options: `-A` → `--all-namespaces`, `-n` →
    `--namespace`, `--standalone`, `--dev`, `-P` → `--peering`, `-p` → `--priority`, `-L
    http://HOST:PORT/healthz` → `--admin-listen HOST:PORT` (its `/healthz`)."""
    flags = []
    if options.clusterwide:
        flags.append("--all-namespaces")
    for namespace in options.namespaces:
        flags += ["--namespace", namespace]
    if options.standalone:
        flags.append("--standalone")
    if options.dev:
        flags.append("--dev")
    if options.peering_name:
        flags += ["--peering", options.peering_name]
    if options.priority is not None:
        flags += ["--priority", str(options.priority)]
    if options.liveness_endpoint:
        address = options.liveness_endpoint.split("://", 1)[-1].split("/", 1)[0]
        flags += ["--admin-listen", address]
    return flags

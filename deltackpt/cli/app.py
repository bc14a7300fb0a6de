"""The parser (every command module registers its own subcommands) and ``main``: run one command, map what
it raised to an exit status, report errors as one line (or JSON)."""

from __future__ import annotations

import argparse
import json
import sys

from .. import __version__
from . import benchmark, interop, listing, maintenance, transfer
from .output import StdoutClosed, emit, out, silence_stdout
from .status import EPILOG, EXIT_OK, EXIT_USAGE, UsageError, exit_code_for

COMMAND_MODULES = (listing, maintenance, transfer, interop, benchmark)


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # argparse would print and exit; main() reports it (as JSON with --json)
        raise UsageError(message, self)


class _Commands:
    """``add(name, func, help)`` -> the new subparser; ``add.group(name, help, dest)`` -> an ``add`` for a
    nested command group (``deltackpt index rebuild``)."""

    def __init__(self, sub, common) -> None:
        self.sub, self.common = sub, common

    def __call__(self, name, func, help_):
        sp = self.sub.add_parser(name, help=help_, description=help_, epilog=EPILOG, parents=[self.common],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
        sp.set_defaults(func=func)
        return sp

    def group(self, name, help_, dest):
        sp = self(name, None, help_)
        return _Commands(sp.add_subparsers(dest=dest, metavar="ACTION", required=True), self.common)


def build_parser() -> argparse.ArgumentParser:
    # --json/--debug are accepted before or after the command: the top level sets the defaults, the
    # subcommands' own copies (separate action objects) default to SUPPRESS so they never reset them.
    def flags(default):
        parser = _Parser(add_help=False)
        parser.add_argument("--json", action="store_true", default=default, help="machine-readable output")
        parser.add_argument("--debug", action="store_true", default=default, help="show tracebacks")
        parser.add_argument("--storage-option", action="append", default=None if default is False else default,
                            metavar="KEY=VALUE",
                            help="fsspec option for s3:// and other URLs, e.g. endpoint_url=http://host:9000 "
                                 "(repeatable; credentials come from the environment or ~/.aws)")
        return parser

    p = _Parser(prog="deltackpt", description="Incremental, content-addressed checkpoint store.",
                epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter, parents=[flags(False)])
    p.add_argument("--version", action="store_true", help="show version and kernel backend")
    add = _Commands(p.add_subparsers(dest="command", metavar="COMMAND"), flags(argparse.SUPPRESS))
    for module in COMMAND_MODULES:
        module.register(add)
    return p


def _version_text() -> str:
    from .. import kernels

    return f"deltackpt {__version__} (kernels: {kernels.BACKEND})"


def _cmd_version(args) -> int:
    from .. import kernels

    emit(args, {"version": __version__, "kernels": kernels.BACKEND}, _version_text)
    return EXIT_OK


def _report_error(exc: BaseException, code: int, as_json: bool) -> None:
    msg = "interrupted" if isinstance(exc, KeyboardInterrupt) and not str(exc) else str(exc) or type(exc).__name__
    if isinstance(exc, KeyError) and msg.startswith("'"):
        msg = msg.strip("'")
    if as_json:
        out(json.dumps({"error": {"type": type(exc).__name__, "message": msg, "exit_code": code}},
                       indent=2, sort_keys=True))
    else:
        print(f"deltackpt: error: {msg}", file=sys.stderr)


def _run(argv: list[str] | None) -> int:
    parser = build_parser()
    as_json = "--json" in (sys.argv[1:] if argv is None else argv)  # also for errors before parsing ends
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # --help and --version-like actions exit 0
        return int(e.code or 0)
    except UsageError as e:
        if as_json:
            _report_error(e, EXIT_USAGE, True)
        else:
            e.parser.print_usage(sys.stderr)
            print(f"{e.parser.prog}: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    if args.version:
        args.func = _cmd_version  # (the kernels' import may fail: a bad DELTACKPT_KERNELS, no native build)
    if not getattr(args, "func", None):
        if args.json:
            _report_error(UsageError("a command is required", parser), EXIT_USAGE, True)
        else:
            parser.print_usage(sys.stderr)
        return EXIT_USAGE
    try:
        return args.func(args)
    except BaseException as exc:  # noqa: BLE001 - mapped to an exit status below
        if isinstance(exc, (SystemExit, StdoutClosed)):
            raise
        code = exit_code_for(exc)
        if args.debug:
            import traceback

            traceback.print_exc()
        if args.json or not args.debug:
            _report_error(exc, code, args.json)
        return code


def main(argv: list[str] | None = None) -> int:
    try:
        code = _run(argv)
    except StdoutClosed:  # (raised by no command of this package now: kept for a caller's own)
        silence_stdout()
        return EXIT_OK
    try:
        sys.stdout.flush()  # a closed pipe shows here, not in the interpreter's own flush at exit
    except BrokenPipeError:
        silence_stdout()  # the reader stopped (`| head -1`): the command's own status stands
    return code

"""The ``deltackpt`` command line. Formats what the engine returns; maps errors to exit codes.

Modules: ``app`` (the parser and ``main``), ``status`` (exit statuses, ``--help`` shows them, and the one
exception -> status table), ``output`` (JSON or text, tables, sizes, progress bars), ``options`` (argument
values several commands share), and one module per group of commands, each registering its own
subcommands: ``listing`` (init, ls, show, du), ``maintenance`` (verify, repair, gc, forget, tag, index),
``transfer`` (copy), ``interop`` (export, import, diff), ``benchmark`` (bench). Nothing else in the package
imports the CLI.
"""

from .app import build_parser, main

__all__ = ["build_parser", "main"]

"""The ``deltackpt`` command line. Formats what the engine returns; maps errors to exit codes.

Exit status (every command):
  0    success
  1    problems found (e.g. verify found damage)
  2    usage error (bad arguments, invalid checkpoint name)
  3    deltackpt error (not a store, unknown checkpoint, corrupt data, ...)
  130  interrupted
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Callable

from . import __version__
from .errors import DeltackptError, InvalidNameError

EXIT_OK, EXIT_PROBLEMS, EXIT_USAGE, EXIT_ERROR, EXIT_INTERRUPTED = 0, 1, 2, 3, 130

EPILOG = """exit status:
  0    success
  1    problems found
  2    usage error (bad arguments, invalid checkpoint name)
  3    deltackpt error (not a store, unknown checkpoint, corrupt data, ...)
  130  interrupted"""


def _exit_code(exc: BaseException) -> int:
    """One table from exception to exit status."""
    if isinstance(exc, KeyboardInterrupt):
        return EXIT_INTERRUPTED
    if isinstance(exc, InvalidNameError):
        return EXIT_USAGE
    if isinstance(exc, DeltackptError):
        return EXIT_ERROR
    if isinstance(exc, (OSError, ValueError)):
        return EXIT_ERROR
    raise exc


def fmt_bytes(n: int | float) -> str:
    n = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def fmt_ratio(x: float) -> str:
    return "inf" if x == float("inf") else f"{x:.2f}x"


def _table(rows: list[list[str]], header: list[str]) -> str:
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    lines = ["  ".join(str(c).ljust(w) if i == 0 else str(c).rjust(w) for i, (c, w) in enumerate(zip(r, widths)))
             for r in [header, *rows]]
    return "\n".join(line.rstrip() for line in lines)


def _emit(args, data, text: Callable[[], str]) -> None:
    if args.json:
        print(json.dumps(data, indent=2, sort_keys=True))
    else:
        print(text())


def _open(args):
    from .store import Store

    return Store.open(args.store)


# -- commands ----------------------------------------------------------------------------------------------
def cmd_init(args) -> int:
    from .store import Store

    overrides = {}
    if args.chunk_size is not None:
        overrides["chunk_size_bytes"] = args.chunk_size
    if args.pack_size is not None:
        overrides["pack_target_bytes"] = args.pack_size
    store = Store.init(args.store, **overrides)
    cfg = store.config
    data = {"store": args.store, "store_id": cfg.store_id, "format_version": cfg.format_version,
            "chunk_size_bytes": cfg.chunk_size_bytes, "pack_target_bytes": cfg.pack_target_bytes}
    _emit(args, data, lambda: f"initialized deltackpt store at {args.store} (id {cfg.store_id[:12]}, "
                              f"format {cfg.format_version}, chunks {fmt_bytes(cfg.chunk_size_bytes)})")
    return EXIT_OK


def cmd_ls(args) -> int:
    store = _open(args)
    infos = store.list_checkpoints()
    data = [
        {"name": i.name, "created_ns": i.created_ns, "parent": i.parent, "logical_bytes": i.logical_bytes,
         "stored_bytes": i.stored_bytes + i.manifest_bytes, "num_items": i.num_items,
         "num_chunks": i.num_chunks, "new_chunks": i.new_chunks,
         "dedup_ratio": (i.logical_bytes / (i.stored_bytes + i.manifest_bytes)) if i.manifest_bytes else None,
         "metadata": i.metadata}
        for i in infos
    ]

    def text():
        if not data:
            return "no checkpoints"
        rows = [[d["name"], time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(d["created_ns"] / 1e9)),
                 fmt_bytes(d["logical_bytes"]), fmt_bytes(d["stored_bytes"]),
                 fmt_ratio(d["logical_bytes"] / d["stored_bytes"]) if d["stored_bytes"] else "-"]
                for d in data]
        return _table(rows, ["NAME", "CREATED", "LOGICAL", "NEW STORED", "DEDUP"])

    _emit(args, data, text)
    return EXIT_OK


def cmd_show(args) -> int:
    store = _open(args)
    m = store.read_manifest(store.resolve(args.checkpoint))
    items = [{"key": it.key, "kind": it.kind, "dtype": it.dtype, "shape": list(it.shape), "nbytes": it.nbytes,
              "num_chunks": len(it.chunks), "group": it.group_name, "global_offset": it.global_offset}
             for it in m.items]
    data = {"name": m.name, "created_ns": m.created_ns, "parent": m.parent, "metadata": m.metadata,
            "stats": {"logical_bytes": m.stats.logical_bytes, "stored_bytes": m.stats.stored_bytes,
                      "num_chunks": m.stats.num_chunks, "new_chunks": m.stats.new_chunks},
            "items": items}

    def text():
        head = (f"checkpoint {m.name}  parent {m.parent or '-'}  items {len(items)}  "
                f"logical {fmt_bytes(m.stats.logical_bytes)}  new {fmt_bytes(m.stats.stored_bytes)}  "
                f"chunks {m.stats.num_chunks} ({m.stats.new_chunks} new)")
        if m.metadata:
            head += "\nmetadata " + json.dumps(m.metadata, sort_keys=True)
        rows = [[d["key"], d["kind"], d["dtype"], "x".join(map(str, d["shape"])) or "-", fmt_bytes(d["nbytes"]),
                 str(d["num_chunks"])] for d in items]
        return head + "\n" + _table(rows, ["ITEM", "KIND", "DTYPE", "SHAPE", "BYTES", "CHUNKS"])

    _emit(args, data, text)
    return EXIT_OK


def cmd_du(args) -> int:
    store = _open(args)
    u = store.usage()
    data = {"num_checkpoints": u.num_checkpoints, "logical_bytes": u.logical_bytes,
            "physical_bytes": u.physical_bytes, "pack_bytes": u.pack_bytes, "manifest_bytes": u.manifest_bytes,
            "num_packs": u.num_packs, "num_chunks": u.num_chunks, "ratio": u.ratio}
    _emit(args, data, lambda: (
        f"checkpoints {u.num_checkpoints}\nlogical     {fmt_bytes(u.logical_bytes)}\n"
        f"physical    {fmt_bytes(u.physical_bytes)} ({u.num_packs} packs, {u.num_chunks} chunks)\n"
        f"ratio       {fmt_ratio(u.ratio)}"))
    return EXIT_OK


def cmd_index_rebuild(args) -> int:
    store = _open(args)
    indexed, dropped = store.rebuild_index()
    chunks = store.index.num_chunks()
    data = {"packs_indexed": indexed, "packs_dropped": dropped, "num_chunks": chunks}
    _emit(args, data, lambda: f"index rebuilt: {indexed} packs, {chunks} chunks")
    return EXIT_OK


def _version_text() -> str:
    from . import kernels

    return f"deltackpt {__version__} (kernels: {kernels.BACKEND})"


def build_parser() -> argparse.ArgumentParser:
    # --json/--debug are accepted before or after the command: the top level sets the defaults, the
    # subcommands' own copies (separate action objects) default to SUPPRESS so they never reset them.
    def flags(default):
        parser = argparse.ArgumentParser(add_help=False)
        parser.add_argument("--json", action="store_true", default=default, help="machine-readable output")
        parser.add_argument("--debug", action="store_true", default=default, help="show tracebacks")
        return parser

    common = flags(argparse.SUPPRESS)
    p = argparse.ArgumentParser(prog="deltackpt", description="Incremental, content-addressed checkpoint store.",
                                epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter,
                                parents=[flags(False)])
    p.add_argument("--version", action="store_true", help="show version and kernel backend")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")

    def add(name, func, help_):
        sp = sub.add_parser(name, help=help_, description=help_, epilog=EPILOG, parents=[common],
                            formatter_class=argparse.RawDescriptionHelpFormatter)
        sp.set_defaults(func=func)
        return sp

    sp = add("init", cmd_init, "create an empty store")
    sp.add_argument("store")
    sp.add_argument("--chunk-size", type=int, help="array chunk size in bytes (default 1 MiB)")
    sp.add_argument("--pack-size", type=int, help="target pack size in bytes (default 32 MiB)")
    sp = add("ls", cmd_ls, "list checkpoints: time, logical bytes, newly stored bytes, dedup ratio")
    sp.add_argument("store")
    sp = add("show", cmd_show, "items of one checkpoint: dtype, shape, chunk counts")
    sp.add_argument("store")
    sp.add_argument("checkpoint", help="checkpoint name or 'latest'")
    sp = add("du", cmd_du, "logical vs physical bytes of the whole store")
    sp.add_argument("store")
    sp = add("index", None, "index cache maintenance")
    isub = sp.add_subparsers(dest="index_command", metavar="ACTION", required=True)
    rp = isub.add_parser("rebuild", help="drop the index cache and re-read every pack table",
                         description="drop the index cache and re-read every pack table", epilog=EPILOG,
                         parents=[common], formatter_class=argparse.RawDescriptionHelpFormatter)
    rp.add_argument("store")
    rp.set_defaults(func=cmd_index_rebuild)
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # argparse exits 2 on usage errors, 0 on --help
        return int(e.code or 0)
    if args.version:
        print(_version_text())
        return EXIT_OK
    if not getattr(args, "func", None):
        parser.print_usage(sys.stderr)
        return EXIT_USAGE
    try:
        return args.func(args)
    except BaseException as exc:  # noqa: BLE001 - mapped to an exit status below
        if isinstance(exc, SystemExit):
            raise
        code = _exit_code(exc)
        if args.debug:
            import traceback

            traceback.print_exc()
        else:
            msg = str(exc) or type(exc).__name__
            if isinstance(exc, KeyError) and msg.startswith("'"):
                msg = msg.strip("'")
            print(f"deltackpt: error: {msg}", file=sys.stderr)
        return code


if __name__ == "__main__":
    sys.exit(main())

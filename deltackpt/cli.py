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
    if isinstance(exc, InvalidNameError) or (isinstance(exc, ValueError) and not isinstance(exc, DeltackptError)):
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


def cmd_verify(args) -> int:
    from .store.retention import parse_duration
    from .store.verify import verify_store

    store = _open(args)
    sample = None
    if args.sample is not None:
        text = args.sample.rstrip("%")
        try:
            sample = float(text) / (100 if args.sample.endswith("%") else 1)
        except ValueError:
            raise ValueError(f"--sample must be a fraction or a percentage, got {args.sample!r}") from None
    max_s = parse_duration(args.max_duration) if args.max_duration else None
    report = verify_store(store, level=args.level, sample=sample, max_duration_s=max_s)

    def text():
        head = (f"verify level {report.level}: {report.num_checkpoints} checkpoints, {report.packs_checked}/"
                f"{report.num_packs} packs, {report.chunks_checked} chunks checked in {report.duration_s:.1f}s"
                + ("" if report.complete else " (partial)"))
        lines = [head]
        for p in report.problems:
            where = " ".join(x for x in (f"pack {p.pack}" if p.pack else "",
                                         f"chunk {p.chunk_id}" if p.chunk_id else "") if x)
            lines.append(f"  {p.kind}: {p.detail} {where}".rstrip())
            if p.items:
                lines.append(f"    affects {', '.join(p.items[:10])}" + (" ..." if len(p.items) > 10 else ""))
        if report.orphan_packs:
            lines.append(f"  {len(report.orphan_packs)} orphan pack(s) no checkpoint uses (removed by gc)")
        lines.append("no problems found" if report.ok
                     else f"{len(report.problems)} problem(s); damaged: {', '.join(report.damaged_checkpoints)}")
        return "\n".join(lines)

    _emit(args, report.as_dict(), text)
    return EXIT_OK if report.ok else EXIT_PROBLEMS


def cmd_gc(args) -> int:
    from .store.gc import plan_gc

    store = _open(args)
    max_unused = float(args.max_unused.rstrip("%")) / (100 if args.max_unused.endswith("%") else 1)
    plan = plan_gc(store, max_unused=max_unused, grace_s=args.grace, wait_s=args.wait)
    if args.dry_run:
        d = plan.as_dict()
        _emit(args, {"dry_run": True, **d}, lambda: (
            f"would delete {len(d['delete_packs'])} pack(s), repack {len(d['repack_packs'])}, remove "
            f"{len(d['temp_files'])} temp file(s); reclaim {fmt_bytes(d['reclaim_bytes'])} "
            f"({d['live_chunks']} live chunks, {d['kept_young_packs']} pack(s) younger than the grace period)"))
        return EXIT_OK
    result = plan.execute(wait_s=args.wait)
    _emit(args, result.as_dict(), lambda: (
        f"deleted {result.deleted_packs} pack(s), repacked {result.repacked_packs} ({result.moved_chunks} chunks "
        f"moved), removed {result.removed_temp_files} temp file(s); reclaimed {fmt_bytes(result.reclaimed_bytes)}"))
    return EXIT_OK


def cmd_forget(args) -> int:
    from .store.retention import plan_forget

    store = _open(args)
    plan = plan_forget(store, keep_last=args.keep_last, keep_every=args.keep_every,
                       keep_within=args.keep_within, keep_tags=args.keep_tag or None)
    if args.dry_run:
        _emit(args, {"dry_run": True, **plan.as_dict()}, lambda: "\n".join(
            [f"keep   {n}  ({', '.join(r)})" for n, r in plan.keep.items()]
            + [f"forget {n}" for n in plan.forget]) or "no checkpoints")
        return EXIT_OK
    removed = plan.execute()
    _emit(args, {"forgotten": removed, "kept": list(plan.keep)},
          lambda: f"forgot {len(removed)} checkpoint(s), kept {len(plan.keep)}; run `deltackpt gc` to reclaim space")
    return EXIT_OK


def cmd_tag(args) -> int:
    from .store.retention import read_tags, set_tags

    store = _open(args)
    name = store.resolve(args.checkpoint)
    tags = set(read_tags(store, name))
    tags |= set(args.add or [])
    tags -= set(args.remove or [])
    final = set_tags(store, name, sorted(tags))
    _emit(args, {"checkpoint": name, "tags": final}, lambda: f"{name}: {', '.join(final) or '(no tags)'}")
    return EXIT_OK


def cmd_bench(args) -> int:
    from .bench import FULL_WORKLOADS, QUICK_WORKLOADS, run_bench
    from .bench.report import markdown

    names = args.workloads.split(",") if args.workloads else list(QUICK_WORKLOADS if args.quick else FULL_WORKLOADS)
    def overrides(pairs) -> dict:  # KEY=VALUE with a JSON value: chunk_size_bytes=262144, delta=false
        out = {}
        for kv in pairs:
            key, sep, value = kv.partition("=")
            try:
                out[key.strip()] = json.loads(value)
            except ValueError:
                raise ValueError(f"expected KEY=JSON_VALUE, got {kv!r}") from None
            if not sep:
                raise ValueError(f"expected KEY=JSON_VALUE, got {kv!r}")
        return out

    variants = {}
    for spec in args.variant or []:
        label, _, pairs = spec.partition(":")
        variants[label] = overrides(pairs.split(",") if pairs else [])
    results = run_bench(args.out, [n.strip() for n in names if n.strip()], size="quick" if args.quick else "full",
                        systems=args.systems.split(",") if args.systems else ("dcp", "deltackpt", "zipnn", "restic"),
                        store_config=overrides(args.store_config or []), variants=variants,
                        restic_compression=args.restic_compression, page_cache=args.page_cache, keep=args.keep)
    _emit(args, results, lambda: markdown(results) + f"\nwritten: {args.out}/results.json, results.md, cumulative_bytes.png")
    bad = [f"{w}/{s}" for w, e in results["workloads"].items() for s, r in e["systems"].items()
           if "error" in r or not r.get("load_bit_exact")]
    return EXIT_PROBLEMS if bad else EXIT_OK


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
    sp.add_argument("--chunk-size", type=int, help="array chunk size in bytes (default 4 MiB)")
    sp.add_argument("--pack-size", type=int, help="target pack size in bytes (default 32 MiB)")
    sp = add("ls", cmd_ls, "list checkpoints: time, logical bytes, newly stored bytes, dedup ratio")
    sp.add_argument("store")
    sp = add("show", cmd_show, "items of one checkpoint: dtype, shape, chunk counts")
    sp.add_argument("store")
    sp.add_argument("checkpoint", help="checkpoint name or 'latest'")
    sp = add("du", cmd_du, "logical vs physical bytes of the whole store")
    sp.add_argument("store")
    sp = add("verify", cmd_verify, "check the store's integrity; exit 1 if damage is found")
    sp.add_argument("store")
    sp.add_argument("--level", type=int, choices=[0, 1, 2], default=1,
                    help="0 structure, 1 + pack hashes (default), 2 + decode and re-hash every chunk")
    sp.add_argument("--sample", help="check only this share of packs, least recently verified first (10%% or 0.1)")
    sp.add_argument("--max-duration", help="stop after this long (e.g. 10m), least recently verified packs first")
    sp = add("gc", cmd_gc, "delete or repack packs no checkpoint needs (takes the exclusive store lock)")
    sp.add_argument("store")
    sp.add_argument("--dry-run", action="store_true", help="print the plan, change nothing")
    sp.add_argument("--max-unused", default="10%", help="repack packs with more dead bytes than this (default 10%%)")
    sp.add_argument("--grace", type=float, default=3600.0,
                    help="never touch packs or temp files younger than this many seconds (default 3600)")
    sp.add_argument("--wait", type=float, default=600.0,
                    help="wait this many seconds for running saves to finish before deleting (default 600)")
    sp = add("forget", cmd_forget, "remove checkpoints by a retention policy (rules are ORed; tagged ones are kept)")
    sp.add_argument("store")
    sp.add_argument("--keep-last", type=int, help="keep the N newest")
    sp.add_argument("--keep-every", type=int, help="keep those whose step is a multiple of K")
    sp.add_argument("--keep-within", help="keep those created within this duration (e.g. 7d, 36h)")
    sp.add_argument("--keep-tag", action="append", help="keep those with this tag (repeatable)")
    sp.add_argument("--dry-run", action="store_true", help="print the plan, change nothing")
    sp = add("tag", cmd_tag, "add or remove tags of a checkpoint; tagged checkpoints are never forgotten")
    sp.add_argument("store")
    sp.add_argument("checkpoint")
    sp.add_argument("add", nargs="*", help="tags to add")
    sp.add_argument("--remove", action="append", help="tag to remove (repeatable)")
    sp = add("bench", cmd_bench, "workload benchmark: DCP vs deltackpt vs ZipNN vs restic on real training runs")
    sp.add_argument("--quick", action="store_true", help="small sizes, dense/frozen/sparse only (< 3 min)")
    sp.add_argument("--out", default="bench-out/workloads", help="output directory (default bench-out/workloads)")
    sp.add_argument("--workloads", help="comma-separated: dense,dense100,frozen,sparse,bf16,reshard")
    sp.add_argument("--systems", help="comma-separated: dcp,deltackpt,zipnn,restic (dcp always runs)")
    sp.add_argument("--store-config", action="append", metavar="KEY=VALUE",
                    help="deltackpt StoreConfig override, e.g. chunk_size_bytes=262144 (repeatable)")
    sp.add_argument("--variant", action="append", metavar="LABEL:KEY=VALUE[,KEY=VALUE]",
                    help="also run deltackpt with these StoreConfig overrides as system deltackpt-LABEL (repeatable)")
    sp.add_argument("--restic-compression", default="auto", choices=["auto", "max", "off"])
    sp.add_argument("--page-cache", default="warm", choices=["warm", "drop"],
                    help="before each load: read the files once (warm) or drop the page cache (root)")
    sp.add_argument("--keep", action="store_true", help="keep the checkpoints written under --out")
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

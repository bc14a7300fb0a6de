"""The ``deltackpt`` command line. Formats what the engine returns; maps errors to exit codes.

The exit status of every command is ``EXIT_STATUS`` (``--help`` shows it, with how errors are reported).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from typing import Callable

from . import __version__
from .errors import DeltackptError, InvalidNameError

EXIT_OK, EXIT_PROBLEMS, EXIT_USAGE, EXIT_ERROR, EXIT_INTERRUPTED = 0, 1, 2, 3, 130

EXIT_STATUS = ((EXIT_OK, "success"), (EXIT_PROBLEMS, "problems found (e.g. verify found damage)"),
               (EXIT_USAGE, "usage error (bad arguments, invalid checkpoint name)"),
               (EXIT_ERROR, "deltackpt error (not a store, unknown checkpoint, corrupt data, ...)"),
               (EXIT_INTERRUPTED, "interrupted"))
EPILOG = "exit status:\n" + "\n".join(f"  {code:<4} {text}" for code, text in EXIT_STATUS) + """

errors: one line on stderr (a traceback with --debug); with --json, this object on stdout instead:
  {"error": {"type": "CheckpointNotFoundError", "message": "...", "exit_code": 3}}
output cut short by a closed pipe (e.g. `| head -1`) is not an error: exit 0, nothing on stderr."""


class UsageError(ValueError):
    """Bad command-line arguments (exit 2); carries the parser whose usage line fits."""

    def __init__(self, message: str, parser: argparse.ArgumentParser):
        super().__init__(message)
        self.parser = parser


class _StdoutClosed(Exception):
    """The reader of our stdout went away (`| head -1`): not an error."""


def _out(text: str) -> None:
    try:
        print(text)
    except BrokenPipeError:
        raise _StdoutClosed from None


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # argparse would print and exit; main() reports it (as JSON with --json)
        raise UsageError(message, self)


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


def parse_fraction(text: str, option: str) -> float:
    """``10%`` or ``0.1`` -> 0.1 (the engine checks the range)."""
    try:
        return float(text[:-1]) / 100 if text.endswith("%") else float(text)
    except ValueError:
        raise ValueError(f"{option} must be a fraction or a percentage (0.1 or 10%), got {text!r}") from None


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not value >= 0 or math.isinf(value):
        raise argparse.ArgumentTypeError(f"expected a number of seconds >= 0, got {text!r}")
    return value


def _table(rows: list[list[str]], header: list[str]) -> str:
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    lines = ["  ".join(str(c).ljust(w) if i == 0 else str(c).rjust(w) for i, (c, w) in enumerate(zip(r, widths)))
             for r in [header, *rows]]
    return "\n".join(line.rstrip() for line in lines)


def _emit(args, data, text: Callable[[], str]) -> None:
    _out(json.dumps(data, indent=2, sort_keys=True) if args.json else text())


def _storage_options(args) -> dict | None:
    """``--storage-option KEY=VALUE`` pairs (VALUE parsed as JSON when it is JSON, else a string)."""
    pairs = getattr(args, "storage_option", None) or []
    out: dict = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise UsageError(f"--storage-option wants KEY=VALUE, got {pair!r}")
        try:
            out[key] = json.loads(value)
        except ValueError:
            out[key] = value
    return out or None


def _options_for(args, location: str) -> dict | None:
    from .store.location import scheme_of

    return _storage_options(args) if scheme_of(location) not in (None, "file") else None


def _open(args):
    from .store import Store

    return Store.open(args.store, storage_options=_options_for(args, args.store))


def _checkpoint_dict(info, tags: list[str]) -> dict:
    """What ``ls`` and ``show`` both report of a checkpoint (one definition of its stored bytes)."""
    ratio = info.dedup_ratio
    return {"name": info.name, "created_ns": info.created_ns, "parent": info.parent,
            "logical_bytes": info.logical_bytes, "stored_bytes": info.added_bytes, "num_items": info.num_items,
            "num_chunks": info.num_chunks, "new_chunks": info.new_chunks,
            "dedup_ratio": None if math.isinf(ratio) else ratio, "tags": tags, "metadata": info.metadata}


# -- commands ----------------------------------------------------------------------------------------------
def cmd_init(args) -> int:
    from .store import Store

    overrides = {}
    if args.chunk_size is not None:
        overrides["chunk_size_bytes"] = args.chunk_size
    if args.pack_size is not None:
        overrides["pack_target_bytes"] = args.pack_size
    store = Store.init(args.store, storage_options=_options_for(args, args.store), **overrides)
    cfg = store.config
    data = {"store": args.store, "store_id": cfg.store_id, "format_version": cfg.format_version,
            "features": list(cfg.features), "chunk_size_bytes": cfg.chunk_size_bytes, "pack_target_bytes": cfg.pack_target_bytes}
    _emit(args, data, lambda: f"initialized deltackpt store at {args.store} (id {cfg.store_id[:12]}, "
                              f"format {cfg.format_version}, chunks {fmt_bytes(cfg.chunk_size_bytes)})")
    return EXIT_OK


def cmd_ls(args) -> int:
    from .store.retention import read_all_tags

    store = _open(args)
    infos = store.list_checkpoints(include_damaged=True)
    tags = read_all_tags(store)
    where, infos = _tiers(args, store, infos)
    data = []
    for i in infos:
        d = {**_checkpoint_dict(i, tags.get(i.name, [])), "location": where.get(i.name, "local"),
             "damaged": i.damaged, "damage": i.damage}
        if i.damaged:  # what only the unreadable manifest knew is unknown, not zero
            d.update(dict.fromkeys(["parent", "logical_bytes", "stored_bytes", "num_items", "num_chunks",
                                    "new_chunks", "dedup_ratio", "metadata"]))
        data.append(d)

    def text():
        if not data:
            return "no checkpoints"
        rows = [[d["name"], time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(d["created_ns"] / 1e9)),
                 *(["-", "-", "-"] if d["damaged"] else
                   [fmt_bytes(d["logical_bytes"]), fmt_bytes(d["stored_bytes"]), fmt_ratio(i.dedup_ratio)]),
                 ",".join(d["tags"]) or "-"] + ([d["location"]] if where else [])
                for i, d in zip(infos, data)]
        header = ["NAME", "CREATED", "LOGICAL", "NEW STORED", "DEDUP", "TAGS"] + (["WHERE"] if where else [])
        if any(d["damaged"] for d in data):
            header.append("STATUS")
            for row, d in zip(rows, data):
                row.append("damaged" if d["damaged"] else "")
        return _table(rows, header)

    _emit(args, data, text)
    return EXIT_OK


def _tiers(args, store, infos):
    """(name -> local/uploading/remote/both, infos with the remote-only checkpoints) for a store whose
    CheckpointManager uploads to a remote; ({}, infos) otherwise. An unreachable remote shows as '?'."""
    from .errors import DeltackptError
    from .store import Store
    from .store.tier import read_tier, tier_states

    record = read_tier(store)
    if record is None:
        return {}, infos
    url = record["remote"]
    try:
        remote = Store.open(url, storage_options=_options_for(args, url))
        where = tier_states(store, remote)
        local = {i.name for i in infos}
        infos = sorted(infos + [i for i in remote.list_checkpoints() if i.name not in local],
                       key=lambda i: (i.created_ns, i.name))
    except (DeltackptError, OSError) as e:
        print(f"deltackpt: warning: remote {url} not reachable ({e}); locations unknown", file=sys.stderr)
        where = {i.name: "?" for i in infos}
    return where, infos


def cmd_show(args) -> int:
    from .store.retention import read_tags

    store = _open(args)
    m = store.read_manifest(store.resolve(args.checkpoint))
    info = store.summarize(m)
    items = [{"key": it.key, "kind": it.kind, "dtype": it.dtype, "shape": list(it.shape), "nbytes": it.nbytes,
              "num_chunks": len(it.chunks), "group": it.group_name, "global_offset": it.global_offset}
             for it in m.items]
    data = {**_checkpoint_dict(info, read_tags(store, m.name)), "items": items}

    def text():
        head = (f"checkpoint {m.name}  parent {m.parent or '-'}  items {len(items)}  "
                f"logical {fmt_bytes(info.logical_bytes)}  new stored {fmt_bytes(info.added_bytes)}  "
                f"dedup {fmt_ratio(info.dedup_ratio)}  chunks {info.num_chunks} ({info.new_chunks} new)")
        if data["tags"]:
            head += f"\ntags {', '.join(data['tags'])}"
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
    with _progress(args) as progress:
        indexed, dropped = store.rebuild_index(progress=progress)
    chunks = store.index.num_chunks()
    data = {"packs_indexed": indexed, "packs_dropped": dropped, "num_chunks": chunks}
    _emit(args, data, lambda: f"index rebuilt: {indexed} packs, {chunks} chunks")
    return EXIT_OK


def cmd_repair(args) -> int:
    from .store.repair import repair_store

    with _progress(args) as progress:
        report = repair_store(args.store, progress=progress)

    def text():
        lines = []
        if report.config_recreated:
            how = "inferred from the manifests" if report.chunk_size_inferred else "default"
            lines.append(f"config recreated: store id {report.store_id[:12]}, chunks "
                         f"{fmt_bytes(report.chunk_size_bytes)} ({how})"
                         + (f"; damaged config kept as {report.config_backup}" if report.config_backup else ""))
        for old, new in sorted(report.rebuilt_packs.items()):
            lines.append(f"pack {old}: table rebuilt from its entries as {', '.join(new)} (old pack kept as "
                         f"packs/{old[:2]}/{old}.damaged)")
        if report.dropped_entries:
            n = report.dropped_entries
            lines.append(f"  {n} damaged {'entry' if n == 1 else 'entries'} could not be recovered (kept in the "
                         ".damaged copy)")
        for name in report.unrecoverable_packs:
            lines.append(f"pack {name}: table damaged and no intact entry found; left as it is")
        lines.append(f"index rebuilt: {report.packs_indexed} packs"
                     + ("" if report.ok else "; run `deltackpt verify --level 2` to see what is affected"))
        if len(lines) == 1 and report.ok:
            lines.insert(0, "nothing to repair")
        return "\n".join(lines)

    _emit(args, report.as_dict(), text)
    return EXIT_OK if report.ok else EXIT_PROBLEMS


def cmd_verify(args) -> int:
    from .store.retention import parse_duration
    from .store.verify import verify_store

    store = _open(args)
    sample = parse_fraction(args.sample, "--sample") if args.sample is not None else None
    max_s = parse_duration(args.max_duration) if args.max_duration else None
    with _progress(args) as progress:
        report = verify_store(store, level=args.level, sample=sample, max_duration_s=max_s, progress=progress)

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
        if not report.complete:
            why = "the sample" if report.skipped_by == "sample" else "the time limit (--max-duration)"
            lines.append(f"partial: checked {report.packs_checked} of {report.packs_checked + report.packs_skipped}"
                         f" packs; {report.packs_skipped} pack(s) and {report.chunks_skipped} chunk(s) not checked"
                         f" because of {why}")
        if not report.ok:
            lines.append(f"{len(report.problems)} problem(s); damaged: {', '.join(report.damaged_checkpoints)}")
        else:
            lines.append("no problems found" + ("" if report.complete else " in what was checked"))
        return "\n".join(lines)

    _emit(args, report.as_dict(), text)
    return EXIT_OK if report.ok else EXIT_PROBLEMS


def cmd_gc(args) -> int:
    from .store.gc import plan_gc

    store = _open(args)
    max_unused = parse_fraction(args.max_unused, "--max-unused")
    with _progress(args) as progress:
        plan = plan_gc(store, max_unused=max_unused, grace_s=args.grace, wait_s=args.wait, progress=progress)
    if args.dry_run:
        d = plan.as_dict()
        _emit(args, {"dry_run": True, **d}, lambda: (
            f"would delete {len(d['delete_packs'])} pack(s), repack {len(d['repack_packs'])}, remove "
            f"{len(d['temp_files'])} temp file(s); reclaim {fmt_bytes(d['reclaim_bytes'])} "
            f"({d['live_chunks']} live chunks, {d['kept_young_packs']} pack(s) younger than the grace period)"))
        return EXIT_OK
    with _progress(args) as progress:
        result = plan.execute(wait_s=args.wait, progress=progress)
    _emit(args, result.as_dict(), lambda: (
        f"deleted {result.deleted_packs} pack(s), repacked {result.repacked_packs} ({result.moved_chunks} chunks "
        f"moved), removed {result.removed_temp_files} temp file(s); reclaimed {fmt_bytes(result.reclaimed_bytes)}"))
    return EXIT_OK


def cmd_forget(args) -> int:
    from .store.retention import plan_forget, plan_forget_names

    policy = dict(keep_last=args.keep_last, keep_every=args.keep_every, keep_within=args.keep_within,
                  keep_tags=args.keep_tag or None)
    if args.names and any(v is not None for v in policy.values()):
        raise ValueError("give checkpoint names or a retention policy (--keep-*), not both")
    store = _open(args)
    plan = plan_forget_names(store, args.names) if args.names else plan_forget(store, **policy)
    if args.dry_run:
        _emit(args, {"dry_run": True, **plan.as_dict()}, lambda: "\n".join(
            [f"keep   {n}  ({', '.join(r)})" for n, r in plan.keep.items()]
            + [f"forget {n}" for n in plan.forget]) or "no checkpoints")
        return EXIT_OK
    removed = plan.execute()
    kept = "" if args.names else f", kept {len(plan.keep)}"
    _emit(args, {"forgotten": removed, "kept": list(plan.keep)},
          lambda: f"forgot {len(removed)} checkpoint(s){kept}; run `deltackpt gc` to reclaim space")
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


def cmd_copy(args) -> int:
    from .store.copy import copy

    if bool(args.checkpoints) == bool(args.all):
        raise UsageError("name the checkpoints to copy, or pass --all")
    with _progress(args) as progress:
        report = copy(args.src, args.dst, None if args.all else args.checkpoints, verify=args.verify,
                      overwrite=args.overwrite, src_storage_options=_options_for(args, args.src),
                      dst_storage_options=_options_for(args, args.dst), progress=progress)
    data = {"src": args.src, "dst": args.dst, "checkpoints": len(report.copied) + len(report.skipped),
            **report.as_dict()}

    def text() -> str:
        lines = [f"copied {len(report.copied)} checkpoint(s), {len(report.skipped)} already there; "
                 f"sent {fmt_bytes(report.bytes_sent)} ({report.packs_sent} packs whole, {report.packs_repacked} "
                 f"repacked, {report.chunks_sent} chunks), skipped {fmt_bytes(report.bytes_skipped)} "
                 f"({report.chunks_skipped} chunks the destination had) in {report.seconds:.1f} s"]
        if report.verified:
            lines.append("verify: " + ("; ".join(report.problems) if report.problems else "every copied checkpoint "
                                       "read back and re-hashed: no problems"))
        return "\n".join(lines)

    _emit(args, data, text)
    return EXIT_PROBLEMS if report.problems else EXIT_OK


class _progress:
    """The engine's progress (deltackpt.store.progress.Progress) as a tqdm bar per phase on stderr when it is a
    terminal and not --json; else nothing. A context manager: a bar an error left open is closed."""

    def __init__(self, args) -> None:
        self.enabled = sys.stderr.isatty() and not args.json
        self.bar = None

    def __enter__(self):
        from .store.progress import NULL_PROGRESS

        return self if self.enabled else NULL_PROGRESS

    def start(self, label: str, total: int, unit: str) -> None:
        from tqdm import tqdm

        self.done()
        if total <= 0:
            return  # nothing to do: no bar
        self.bar = tqdm(total=total, desc=label, unit=unit, unit_scale=unit == "B", unit_divisor=1024,
                        file=sys.stderr, leave=False, dynamic_ncols=True)

    def advance(self, n: int = 1) -> None:
        if self.bar is not None:
            self.bar.update(n)

    def done(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None

    def __exit__(self, *exc) -> None:
        self.done()


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
        parser = _Parser(add_help=False)
        parser.add_argument("--json", action="store_true", default=default, help="machine-readable output")
        parser.add_argument("--debug", action="store_true", default=default, help="show tracebacks")
        parser.add_argument("--storage-option", action="append", default=None if default is False else default,
                            metavar="KEY=VALUE",
                            help="fsspec option for s3:// and other URLs, e.g. endpoint_url=http://host:9000 "
                                 "(repeatable; credentials come from the environment or ~/.aws)")
        return parser

    common = flags(argparse.SUPPRESS)
    p = _Parser(prog="deltackpt", description="Incremental, content-addressed checkpoint store.",
                epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter, parents=[flags(False)])
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
    sp = add("repair", cmd_repair, "recreate a missing or damaged config and rebuild damaged pack tables from "
                                   "their entries, then the index (deletes nothing; exit 1 if data stays lost)")
    sp.add_argument("store")
    sp = add("gc", cmd_gc, "delete or repack packs no checkpoint needs (takes the exclusive store lock)")
    sp.add_argument("store")
    sp.add_argument("--dry-run", action="store_true", help="print the plan, change nothing")
    sp.add_argument("--max-unused", default="10%", help="repack packs with more dead bytes than this (default 10%%)")
    sp.add_argument("--grace", type=_seconds, default=3600.0,
                    help="never touch packs or temp files younger than this many seconds (default 3600)")
    sp.add_argument("--wait", type=_seconds, default=600.0,
                    help="wait this many seconds for running saves to finish before deleting (default 600)")
    sp = add("forget", cmd_forget, "remove checkpoints by a retention policy (rules are ORed; tagged ones and the "
                                   "newest are kept) or exactly the named ones (tagged ones are refused)")
    sp.add_argument("store")
    sp.add_argument("names", nargs="*", metavar="NAME", help="forget exactly these checkpoints ('latest' = newest)")
    sp.add_argument("--keep-last", type=int, help="keep the N newest")
    sp.add_argument("--keep-every", type=int,
                    help="keep those whose metadata 'step' (an int; CheckpointManager writes it) is a multiple of K")
    sp.add_argument("--keep-within", help="keep those created within this duration (e.g. 7d, 36h; more than 0)")
    sp.add_argument("--keep-tag", action="append", help="keep those with this tag (repeatable)")
    sp.add_argument("--dry-run", action="store_true", help="print the plan, change nothing")
    sp = add("tag", cmd_tag, "add or remove tags of a checkpoint; tagged checkpoints are never forgotten")
    sp.add_argument("store")
    sp.add_argument("checkpoint")
    sp.add_argument("add", nargs="*", help="tags to add")
    sp.add_argument("--remove", action="append", help="tag to remove (repeatable)")
    sp = add("copy", cmd_copy, "copy checkpoints to another store (path or URL), sending only what it lacks; "
                               "the destination is created with the source's settings")
    sp.add_argument("src", help="source store (path or URL, e.g. s3://bucket/run)")
    sp.add_argument("dst", help="destination store (path or URL)")
    sp.add_argument("checkpoints", nargs="*", metavar="CKPT", help="checkpoints to copy ('latest' = newest)")
    sp.add_argument("--all", action="store_true", help="copy every checkpoint")
    sp.add_argument("--verify", action="store_true", help="read every copied checkpoint back and re-hash it")
    sp.add_argument("--overwrite", action="store_true", help="replace same-named checkpoints that differ")
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


def _report_error(exc: BaseException, code: int, as_json: bool) -> None:
    msg = str(exc) or type(exc).__name__
    if isinstance(exc, KeyError) and msg.startswith("'"):
        msg = msg.strip("'")
    if as_json:
        _out(json.dumps({"error": {"type": type(exc).__name__, "message": msg, "exit_code": code}},
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
        _out(_version_text())
        return EXIT_OK
    if not getattr(args, "func", None):
        if args.json:
            _report_error(UsageError("a command is required", parser), EXIT_USAGE, True)
        else:
            parser.print_usage(sys.stderr)
        return EXIT_USAGE
    try:
        return args.func(args)
    except BaseException as exc:  # noqa: BLE001 - mapped to an exit status below
        if isinstance(exc, (SystemExit, _StdoutClosed)):
            raise
        code = _exit_code(exc)
        if args.debug:
            import traceback

            traceback.print_exc()
        if args.json or not args.debug:
            _report_error(exc, code, args.json)
        return code


def main(argv: list[str] | None = None) -> int:
    try:
        code = _run(argv)
        try:
            sys.stdout.flush()  # a closed pipe shows here, not in the interpreter's own flush at exit
        except BrokenPipeError:
            raise _StdoutClosed from None
    except _StdoutClosed:
        # The reader stopped (`| head -1`): not an error. Point stdout at /dev/null so the final flush at
        # exit cannot fail again (the recipe in Python's signal docs), and exit quietly.
        try:
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        except (OSError, ValueError):
            pass  # stdout is not a file descriptor (captured): nothing to silence
        return EXIT_OK
    return code


if __name__ == "__main__":
    sys.exit(main())

"""Commands that move checkpoints in and out of other formats, and compare two: export, import, diff."""

from __future__ import annotations

from .options import options_for
from .output import ProgressBar, emit, fmt_bytes, fmt_ratio, table
from .status import EXIT_OK, UsageError


def register(add) -> None:
    sp = add("export", cmd_export, "write a checkpoint as a plain DCP directory, one torch.save file or a "
                                   "safetensors file (consolidated from any sharding; never overwrites)")
    sp.add_argument("store")
    sp.add_argument("checkpoint", help="checkpoint name or 'latest'")
    sp.add_argument("out", help="the directory (dcp) or file (torch, safetensors) to create")
    sp.add_argument("--format", required=True, choices=["dcp", "torch", "safetensors"])
    sp.add_argument("--only", nargs="+", action="extend", metavar="PREFIX",
                    help="keep only keys starting with one of these (e.g. model.)")
    sp.add_argument("--dtype", choices=["bf16", "fp32"],
                    help="cast every float16/bfloat16/float32/float64 tensor to this dtype (float8 stays; a dcp "
                         "export copies a pickled value, such as a tuple of tensors, as it is)")
    sp = add("import", cmd_import, "import a DCP checkpoint directory (stock FileSystemWriter), a torch.save file "
                                   "(weights_only) or a safetensors file as a checkpoint, stored incrementally")
    sp.add_argument("store", help="the store (created if absent)")
    sp.add_argument("src", nargs="?", help="a DCP checkpoint directory, a torch.save or a safetensors file")
    sp.add_argument("--name", help="checkpoint name (default: SRC's name less its suffix; needed when that is not "
                                   "a valid checkpoint name)")
    sp.add_argument("--all", metavar="DIR",
                    help="import every DCP checkpoint directory under DIR in step order (names kept; names the "
                         "store has are skipped, and so are links to a directory imported anyway, e.g. latest -> "
                         "step-200, and directories whose name cannot be a checkpoint's, with a note: import "
                         "such a one alone with --name)")
    sp = add("diff", cmd_diff, "what changed from checkpoint A to B, per item: shape/dtype, added/removed, "
                               "changed elements, bytes and chunks, max |a-b|, relative L2 change")
    sp.add_argument("store")
    sp.add_argument("a", help="checkpoint name or 'latest'")
    sp.add_argument("b", help="checkpoint name or 'latest'")
    sp.add_argument("--top", type=int, default=20, help="show the N most changed items (default 20; 0 = all)")


def cmd_export(args) -> int:
    from ..interop.export import export

    with ProgressBar(args) as progress:
        report = export(args.store, args.checkpoint, args.out, format=args.format, only=args.only,
                        dtype=args.dtype, progress=progress, storage_options=options_for(args, args.store))

    def text() -> str:
        what = f"{report.num_tensors} tensors" + (f", {report.num_values} other values" if report.num_values else "")
        lines = [f"exported {report.checkpoint} as {report.format} to {report.out}: {what}, "
                 f"{fmt_bytes(report.bytes_written)} in {report.seconds:.1f} s"
                 + (f"; {report.converted} tensors cast to {args.dtype}" if report.converted else "")]
        lines += [f"  skipped {note}" for note in report.skipped]
        return "\n".join(lines)

    emit(args, report.as_dict(), text)
    return EXIT_OK


def cmd_import(args) -> int:
    from ..interop.importer import import_all, import_checkpoint

    if bool(args.src) == bool(args.all):
        raise UsageError("give a source to import (SRC) or --all DIR, not both")
    if args.all and args.name:
        raise UsageError("--name names one import; --all keeps each directory's name")
    opts = options_for(args, args.store)
    with ProgressBar(args) as progress:
        if args.all:
            reports = import_all(args.store, args.all, progress=progress, storage_options=opts)
        else:
            reports = [import_checkpoint(args.store, args.src, args.name, progress=progress, storage_options=opts)]
    done = [r for r in reports if not r.skipped]
    source = sum(r.source_bytes for r in done)
    stored = sum(r.stored_bytes for r in done)
    total = {"source_bytes": source, "stored_bytes": stored, "ratio": source / stored if stored else None}
    data = {"imported": [r.as_dict() for r in reports], "total": total}

    def text() -> str:
        rows = [[r.name, fmt_bytes(r.source_bytes) if r.source_bytes or not r.skipped else "-",
                 "-" if r.skipped else fmt_bytes(r.stored_bytes), _skip_label(r) if r.skipped else fmt_ratio(r.ratio)]
                for r in reports]
        out = table(rows, ["NAME", "SOURCE", "NEW STORED", "RATIO"])
        if len(reports) > 1:
            out += (f"\nimported {len(done)} checkpoint(s): {fmt_bytes(source)} of source stored in "
                    f"{fmt_bytes(stored)} ({fmt_ratio(source / stored if stored else float('inf'))})")
        out += "".join(f"\nskipped {r.source}: {r.note}" for r in reports if r.skipped and r.note != "exists")
        return out

    emit(args, data, text)
    return EXIT_OK


def _skip_label(report) -> str:
    return "exists, skipped" if report.note == "exists" else "skipped (see below)"


def cmd_diff(args) -> int:
    from ..interop.diff import diff

    if args.top < 0:
        raise UsageError("--top must be >= 0")
    with ProgressBar(args) as progress:
        report = diff(args.store, args.a, args.b, progress=progress, storage_options=options_for(args, args.store))

    def text() -> str:
        t = report.totals()
        head = (f"{report.a} -> {report.b}: {t['items']} items, {t['unchanged']} unchanged, {t['changed']} changed, "
                f"{t['shape_or_dtype']} shape/dtype changed, {t['added']} added, {t['removed']} removed; "
                f"{fmt_bytes(t['changed_bytes'])} in {t['changed_chunks']} chunks changed "
                f"({fmt_bytes(t['decoded_bytes'])} decoded)")
        top = report.top(args.top or None)
        if not top:
            return head + "\nidentical"
        rows = [[i.name, _status(i), _fraction(i), fmt_bytes(i.changed_bytes),
                 "-" if i.changed_chunks is None else f"{i.changed_chunks}/{i.num_chunks}",
                 _number(i.max_abs_diff), _number(i.rel_l2)] for i in top]
        more = len(report.top()) - len(top)
        return (head + "\n" + table(rows, ["ITEM", "STATUS", "ELEMENTS", "BYTES", "CHUNKS", "MAX |A-B|", "REL L2"])
                + (f"\n... {more} more changed item(s) (--top 0 shows all)" if more > 0 else ""))

    emit(args, report.as_dict(), text)
    return EXIT_OK


def _status(i) -> str:
    if i.status == "shape":
        return f"shape {'x'.join(map(str, i.shape_a))}->{'x'.join(map(str, i.shape_b))}"
    if i.status == "dtype":
        return f"dtype {i.dtype_a or 'value'}->{i.dtype_b or 'value'}"
    return i.status


def _fraction(i) -> str:
    f = i.changed_fraction
    return "-" if f is None else f"{f:.2%}"


def _number(x) -> str:
    return "-" if x is None else f"{x:.3g}"

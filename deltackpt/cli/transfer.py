"""Commands that move checkpoints between stores: copy."""

from __future__ import annotations

from .options import options_for
from .output import ProgressBar, emit, fmt_bytes
from .status import EXIT_OK, EXIT_PROBLEMS, UsageError


def register(add) -> None:
    sp = add("copy", cmd_copy, "copy checkpoints to another store (path or URL), sending only what it lacks; "
                               "the destination is created with the source's settings")
    sp.add_argument("src", help="source store (path or URL, e.g. s3://bucket/run)")
    sp.add_argument("dst", help="destination store (path or URL)")
    sp.add_argument("checkpoints", nargs="*", metavar="CKPT", help="checkpoints to copy ('latest' = newest)")
    sp.add_argument("--all", action="store_true", help="copy every checkpoint")
    sp.add_argument("--verify", action="store_true", help="read every copied checkpoint back and re-hash it")
    sp.add_argument("--overwrite", action="store_true", help="replace same-named checkpoints that differ")
    for side in ("src", "dst"):
        sp.add_argument(f"--{side}-storage-option", action="append", metavar="KEY=VALUE",
                        help=f"fsspec option for the {'source' if side == 'src' else 'destination'} URL only, in "
                             "place of --storage-option (two object stores with their own endpoints or "
                             "credentials; repeatable)")


def cmd_copy(args) -> int:
    from ..store.copy import copy

    if bool(args.checkpoints) == bool(args.all):
        raise UsageError("name the checkpoints to copy, or pass --all")
    with ProgressBar(args) as progress:
        report = copy(args.src, args.dst, None if args.all else args.checkpoints, verify=args.verify,
                      overwrite=args.overwrite, src_storage_options=options_for(args, args.src, "src"),
                      dst_storage_options=options_for(args, args.dst, "dst"), progress=progress)
    data = {"src": args.src, "dst": args.dst, "checkpoints": len(report.copied) + len(report.skipped),
            **report.as_dict()}

    def text() -> str:
        lines = [f"copied {len(report.copied)} checkpoint(s), {len(report.skipped)} already there; "
                 f"sent {fmt_bytes(report.bytes_sent)} ({report.packs_sent} packs whole, {report.packs_repacked} "
                 f"repacked, {report.chunks_sent} chunks), did not send {fmt_bytes(report.bytes_skipped)} "
                 f"({report.chunks_skipped} chunks the destination already had) in {report.seconds:.1f} s"]
        if report.damaged:
            lines.append(f"not copied, manifest damaged in the source: {', '.join(report.damaged)} (`deltackpt "
                         "verify` the source)")
        if report.forgotten:
            lines.append(f"not copied, forgotten in the source during the copy: {', '.join(report.forgotten)}")
        if report.verified:
            lines.append("verify: " + ("; ".join(report.problems) if report.problems else "every copied checkpoint "
                                       "read back and re-hashed: no problems"))
        return "\n".join(lines)

    emit(args, data, text)
    return EXIT_PROBLEMS if report.problems or report.damaged else EXIT_OK

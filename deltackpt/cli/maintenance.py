"""Commands that check or change a store's contents: verify, repair, gc, forget, tag, index rebuild."""

from __future__ import annotations

from .options import count, duration, open_store, parse_fraction, seconds
from .output import ProgressBar, emit, fmt_bytes
from .status import EXIT_OK, EXIT_PROBLEMS, UsageError


def register(add) -> None:
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
    sp.add_argument("--no-merge", action="store_true",
                    help="leave small packs as they are (by default packs under 1/8 of the pack size are merged "
                         "into full-size packs once they add up to 1/8 of it, or number 256)")
    sp.add_argument("--grace", type=seconds, default=3600.0,
                    help="never touch packs or temp files younger than this many seconds (default 3600)")
    sp.add_argument("--wait", type=seconds, default=600.0,
                    help="wait this many seconds for running saves to finish before deleting (default 600)")
    sp = add("forget", cmd_forget, "remove checkpoints by a retention policy (rules are ORed; tagged ones and the "
                                   "newest are kept) or exactly the named ones (tagged ones are refused)")
    sp.add_argument("store")
    sp.add_argument("names", nargs="*", metavar="NAME", help="forget exactly these checkpoints ('latest' = newest)")
    sp.add_argument("--keep-last", type=count, help="keep the N newest")
    sp.add_argument("--keep-every", type=count,
                    help="keep those whose metadata 'step' (an int; CheckpointManager writes it) is a multiple of K")
    sp.add_argument("--keep-within", type=duration,
                    help="keep those created within this duration (e.g. 7d, 36h; more than 0)")
    sp.add_argument("--keep-tag", action="append", help="keep those with this tag (repeatable)")
    sp.add_argument("--dry-run", action="store_true", help="print the plan, change nothing")
    sp = add("tag", cmd_tag, "add or remove tags of a checkpoint; tagged checkpoints are never forgotten")
    sp.add_argument("store")
    sp.add_argument("checkpoint")
    sp.add_argument("add", nargs="*", help="tags to add")
    sp.add_argument("--remove", action="append", help="tag to remove (repeatable)")
    index = add.group("index", "index cache maintenance", dest="index_command")
    sp = index("rebuild", cmd_index_rebuild, "drop the index cache and re-read every pack table")
    sp.add_argument("store")


def cmd_index_rebuild(args) -> int:
    store = open_store(args)
    with ProgressBar(args) as progress:
        indexed, dropped = store.rebuild_index(progress=progress)
    chunks = store.index.num_chunks()
    data = {"packs_indexed": indexed, "packs_dropped": dropped, "num_chunks": chunks}
    emit(args, data, lambda: f"index rebuilt: {indexed} packs, {chunks} chunks")
    return EXIT_OK


def cmd_repair(args) -> int:
    from ..store.repair import repair_store

    with ProgressBar(args) as progress:
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

    emit(args, report.as_dict(), text)
    return EXIT_OK if report.ok else EXIT_PROBLEMS


def cmd_verify(args) -> int:
    from ..store.retention import parse_duration
    from ..store.verify import verify_store

    store = open_store(args)
    sample = parse_fraction(args.sample, "--sample") if args.sample is not None else None
    max_s = parse_duration(args.max_duration) if args.max_duration else None
    with ProgressBar(args) as progress:
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
            why = {"sample": "the sample", "concurrent-gc": "a gc that moved them meanwhile (run verify again)"
                   }.get(report.skipped_by, "the time limit (--max-duration)")
            lines.append(f"partial: checked {report.packs_checked} of {report.packs_checked + report.packs_skipped}"
                         f" packs; {report.packs_skipped} pack(s) and {report.chunks_skipped} chunk(s) not checked"
                         f" because of {why}")
        if not report.ok:
            damaged = f"; damaged: {', '.join(report.damaged_checkpoints)}" if report.damaged_checkpoints else ""
            lines.append(f"{len(report.problems)} problem(s){damaged}")
        else:
            lines.append("no problems found" + ("" if report.complete else " in what was checked"))
        return "\n".join(lines)

    emit(args, report.as_dict(), text)
    return EXIT_OK if report.ok else EXIT_PROBLEMS


def cmd_gc(args) -> int:
    from ..store.gc import plan_gc

    store = open_store(args)
    max_unused = parse_fraction(args.max_unused, "--max-unused")
    with ProgressBar(args) as progress:
        plan = plan_gc(store, max_unused=max_unused, grace_s=args.grace, merge_small=not args.no_merge,
                       wait_s=args.wait, progress=progress)
    if args.dry_run:
        d = plan.as_dict()
        emit(args, {"dry_run": True, **d}, lambda: (
            f"would delete {len(d['delete_packs'])} pack(s), repack {len(d['repack_packs'])}, merge "
            f"{len(d['merge_packs'])} small pack(s)"
            + (f" (into about {d['new_packs']} new pack(s) with the repacked chunks)" if d['merge_packs'] else "")
            + f", remove {len(d['temp_files'])} temp file(s); reclaim {fmt_bytes(d['reclaim_bytes'])} "
            f"({d['live_chunks']} live chunks, {d['kept_young_packs']} pack(s) younger than the grace period)"))
        return EXIT_OK
    with ProgressBar(args) as progress:
        result = plan.execute(wait_s=args.wait, progress=progress)
    emit(args, result.as_dict(), lambda: (
        f"deleted {result.deleted_packs} pack(s), repacked {result.repacked_packs} and merged {result.merged_packs} "
        f"small pack(s) into {result.new_packs} ({result.moved_chunks} chunks moved), removed "
        f"{result.removed_temp_files} temp file(s); reclaimed {fmt_bytes(result.reclaimed_bytes)}"
        + "".join(f"\ndamaged pack {n}: does not hash to its name; left as it is (run verify, then repair)"
                  for n in result.damaged_packs)))
    return EXIT_PROBLEMS if result.damaged_packs else EXIT_OK


def cmd_forget(args) -> int:
    from ..store.retention import plan_forget, plan_forget_names

    policy = dict(keep_last=args.keep_last, keep_every=args.keep_every, keep_within=args.keep_within,
                  keep_tags=args.keep_tag or None)
    if args.names and any(v is not None for v in policy.values()):
        raise ValueError("give checkpoint names or a retention policy (--keep-*), not both")
    if not args.names and all(v is None for v in policy.values()):
        raise ValueError("give checkpoint names or a retention policy (--keep-last, --keep-every, --keep-within, "
                         "--keep-tag)")
    store = open_store(args)
    plan = plan_forget_names(store, args.names) if args.names else plan_forget(store, **policy)
    if args.dry_run:
        emit(args, {"dry_run": True, **plan.as_dict()}, lambda: "\n".join(
            [f"keep   {n}  ({', '.join(r)})" for n, r in plan.keep.items()]
            + [f"forget {n}" for n in plan.forget]) or "no checkpoints")
        return EXIT_OK
    removed = plan.execute()
    kept = "" if args.names else f", kept {len(plan.keep)}"
    emit(args, {"forgotten": removed, "kept": list(plan.keep)},
         lambda: f"forgot {len(removed)} checkpoint(s){kept}; run `deltackpt gc` to reclaim space")
    return EXIT_OK


def cmd_tag(args) -> int:
    from ..store.retention import DAMAGED_TAGS, read_tags, set_tags

    if DAMAGED_TAGS in (args.add or []):
        raise UsageError(f"invalid tag {DAMAGED_TAGS!r}: 1-64 letters, digits and . _ + = @ -")
    store = open_store(args)
    name = store.resolve(args.checkpoint)
    tags = set(read_tags(store, name))
    if not args.add and not args.remove:  # a query: written back, a damaged tags object (still a pin) would go
        shown = sorted(tags)
        emit(args, {"checkpoint": name, "tags": shown}, lambda: f"{name}: {', '.join(shown) or '(no tags)'}")
        return EXIT_OK
    tags |= set(args.add or [])
    tags -= set(args.remove or [])
    final = set_tags(store, name, sorted(tags))
    emit(args, {"checkpoint": name, "tags": final}, lambda: f"{name}: {', '.join(final) or '(no tags)'}")
    return EXIT_OK

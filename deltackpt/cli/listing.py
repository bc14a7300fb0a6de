"""Commands that create a store or read what it holds: init, ls, show, du."""

from __future__ import annotations

import json
import math
import sys
import time

from .options import open_store, options_for
from .output import emit, fmt_bytes, fmt_ratio, jsonable, table
from .status import EXIT_OK


def register(add) -> None:
    sp = add("init", cmd_init, "create an empty store")
    sp.add_argument("store")
    sp.add_argument("--chunk-size", type=int, help="array chunk size in bytes (default 4 MiB)")
    sp.add_argument("--pack-size", type=int, help="target pack size in bytes (default 32 MiB)")
    sp.add_argument("--max-chain", type=int,
                    help="most deltas a chunk's restore decodes down its chain (default 8)")
    sp.add_argument("--chain-links", choices=["sparse", "all"],
                    help="which deltas the next delta may build on: sparse (default: only sparse-row deltas, "
                         "loads as fast as depth 1) or all (fewest bytes, slower loads of late checkpoints)")
    sp = add("ls", cmd_ls, "list checkpoints: time, logical bytes, newly stored bytes, dedup ratio")
    sp.add_argument("store")
    sp.add_argument("--remote-storage-option", action="append", metavar="KEY=VALUE",
                    help="fsspec option for the remote of a tiered store only, in place of --storage-option "
                         "(a remote with its own endpoint or credentials; repeatable)")
    sp = add("show", cmd_show, "items of one checkpoint: dtype, shape, chunk counts")
    sp.add_argument("store")
    sp.add_argument("checkpoint", help="checkpoint name or 'latest'")
    sp = add("du", cmd_du, "logical vs physical bytes of the whole store, and its settings")
    sp.add_argument("store")


def checkpoint_dict(info, tags: list[str]) -> dict:
    """What ``ls`` and ``show`` both report of a checkpoint (one definition of its stored bytes)."""
    ratio = info.dedup_ratio
    return {"name": info.name, "created_ns": info.created_ns, "parent": info.parent,
            "logical_bytes": info.logical_bytes, "stored_bytes": info.added_bytes, "num_items": info.num_items,
            "num_chunks": info.num_chunks, "new_chunks": info.new_chunks,
            "dedup_ratio": None if math.isinf(ratio) else ratio, "tags": tags, "metadata": info.metadata}


def store_settings(cfg) -> dict:
    """What ``init`` and ``du`` report of a store's config."""
    return {"format_version": cfg.format_version, "features": list(cfg.features),
            "chunk_size_bytes": cfg.chunk_size_bytes, "pack_target_bytes": cfg.pack_target_bytes,
            "max_chain": cfg.max_chain, "chain_links": cfg.chain_links}


def cmd_init(args) -> int:
    from ..store import Store

    overrides = {}
    if args.chunk_size is not None:
        overrides["chunk_size_bytes"] = args.chunk_size
    if args.pack_size is not None:
        overrides["pack_target_bytes"] = args.pack_size
    if args.max_chain is not None:
        overrides["max_chain"] = args.max_chain
    if args.chain_links is not None:
        overrides["chain_links"] = args.chain_links
    store = Store.init(args.store, storage_options=options_for(args, args.store), **overrides)
    cfg = store.config
    data = {"store": args.store, "store_id": cfg.store_id, **store_settings(cfg)}
    emit(args, data, lambda: f"initialized deltackpt store at {args.store} (id {cfg.store_id[:12]}, "
                             f"format {cfg.format_version}, chunks {fmt_bytes(cfg.chunk_size_bytes)})")
    return EXIT_OK


def cmd_ls(args) -> int:
    from ..store.retention import read_all_tags

    store = open_store(args)
    infos = store.list_checkpoints(include_damaged=True)
    tags = read_all_tags(store)
    where, infos, remote_tags = _tiers(args, store, infos)
    for name, pinned in remote_tags.items():  # a checkpoint pinned on the remote (its retention keeps it)
        tags[name] = sorted(set(tags.get(name, [])) | set(pinned))
    data = []
    for i in infos:
        d = {**checkpoint_dict(i, tags.get(i.name, [])), "location": where.get(i.name, "local"),
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
        return table(rows, header)

    emit(args, data, text)
    return EXIT_OK


def _tiers(args, store, infos):
    """(name -> local/uploading/remote/both, infos with the remote-only checkpoints, the remote's tags) for a
    store whose CheckpointManager uploads to a remote; ({}, infos, {}) otherwise. An unreachable remote shows
    as '?'."""
    from ..errors import DeltackptError
    from ..store import Store
    from ..store.retention import read_all_tags
    from ..store.tier import read_tier, tier_states

    record = read_tier(store)
    remote_tags: dict = {}
    if record is None:
        return {}, infos, remote_tags
    url = record["remote"]
    try:
        remote = Store.open(url, storage_options=options_for(args, url, "remote"))
        if record["remote_id"] is not None and remote.config.store_id != record["remote_id"]:
            raise DeltackptError(f"the store there is not the one uploaded to (store id {remote.config.store_id}, "
                                 f"expected {record['remote_id']})")
        remote_infos = remote.list_checkpoints(include_damaged=True)
        where = tier_states(store, remote, local_infos=infos, remote_infos=remote_infos)
        local = {i.name for i in infos}
        infos = sorted(infos + [i for i in remote_infos if i.name not in local and not i.damaged],
                       key=lambda i: (i.created_ns, i.name))
        remote_tags = {n: t for n, t in read_all_tags(remote).items() if where.get(n) in ("remote", "both")}
    except (DeltackptError, OSError) as e:
        print(f"deltackpt: warning: remote {url} not reachable ({e}); locations unknown", file=sys.stderr)
        where = {i.name: "?" for i in infos}
    return where, infos, remote_tags


def cmd_show(args) -> int:
    from ..store.retention import read_tags

    store = open_store(args)
    m = store.read_manifest(store.resolve(args.checkpoint))
    info = store.summarize(m)
    items = [{"key": it.key, "kind": it.kind, "dtype": it.dtype, "shape": list(it.shape), "nbytes": it.nbytes,
              "num_chunks": len(it.chunks), "group": it.group_name, "global_offset": it.global_offset}
             for it in m.items]
    data = {**checkpoint_dict(info, read_tags(store, m.name)), "items": items}

    def text():
        head = (f"checkpoint {m.name}  parent {m.parent or '-'}  items {len(items)}  "
                f"logical {fmt_bytes(info.logical_bytes)}  new stored {fmt_bytes(info.added_bytes)}  "
                f"dedup {fmt_ratio(info.dedup_ratio)}  chunks {info.num_chunks} ({info.new_chunks} new)")
        if data["tags"]:
            head += f"\ntags {', '.join(data['tags'])}"
        if m.metadata:
            head += "\nmetadata " + json.dumps(jsonable(m.metadata), sort_keys=True)
        rows = [[d["key"], d["kind"], d["dtype"], "x".join(map(str, d["shape"])) or "-", fmt_bytes(d["nbytes"]),
                 str(d["num_chunks"])] for d in items]
        return head + "\n" + table(rows, ["ITEM", "KIND", "DTYPE", "SHAPE", "BYTES", "CHUNKS"])

    emit(args, data, text)
    return EXIT_OK


def cmd_du(args) -> int:
    store = open_store(args)
    u = store.usage()
    cfg = store.config
    settings = store_settings(cfg)
    data = {"num_checkpoints": u.num_checkpoints, "logical_bytes": u.logical_bytes,
            "physical_bytes": u.physical_bytes, "pack_bytes": u.pack_bytes, "manifest_bytes": u.manifest_bytes,
            "other_bytes": u.other_bytes, "num_packs": u.num_packs, "num_chunks": u.num_chunks, "ratio": u.ratio,
            "settings": settings}
    emit(args, data, lambda: (
        f"checkpoints {u.num_checkpoints}\nlogical     {fmt_bytes(u.logical_bytes)}\n"
        f"physical    {fmt_bytes(u.physical_bytes)} ({u.num_packs} packs, {u.num_chunks} chunks; "
        f"{fmt_bytes(u.other_bytes)} more in commit records and tags)\n"
        f"ratio       {fmt_ratio(u.ratio)}\n"
        f"settings    chunks {fmt_bytes(cfg.chunk_size_bytes)}, packs {fmt_bytes(cfg.pack_target_bytes)}, "
        f"max_chain {cfg.max_chain}, chain_links {cfg.chain_links}, format {cfg.format_version}"))
    return EXIT_OK

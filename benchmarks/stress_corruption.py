"""Corruption stress: inject random damage into copies of a populated store and check that verify finds it.

Each injection copies a template store (six checkpoints with keyframes, deltas and byte items, one orphan
pack from an uncommitted writer, and its LMDB index cache), damages the copy in one way, and runs
``verify_store(level=2)``.

Damage to committed data (must be detected: verify returns a report that is not ok):
  pack-flip          one bit anywhere in a pack some checkpoint uses
  frame-header-flip  one bit in the zstd frame header of a compressed chunk
  pack-truncate      a used pack cut short
  pack-delete        a used pack removed
  manifest-flip      one bit in a manifest
  manifest-truncate  a manifest cut short
Damage to nothing committed (verify must stay clean; the cache is rebuilt or re-derived):
  orphan-pack-flip   one bit in the orphan pack
  cache-delete       the LMDB index cache removed
  cache-flip         a few random bytes of the LMDB data file flipped (checked in a child process)
  index-record       one cached index record rewritten with a wrong offset / pack / length field

For damage to committed data the report's ``damaged_checkpoints`` is also compared with the checkpoints
that really depend on the damaged bytes (through delta bases too): ``mapped`` counts exact matches.

Prints one JSON line ``{"injections": N, "detected": M, "committed_damage": K, "by_kind": {...}, ...}``;
exit status 1 unless every committed-data injection was detected and every other one left verify clean.

    python benchmarks/stress_corruption.py --injections 200
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
SMALL = dict(chunk_size_bytes=4096, pack_target_bytes=65536, cdc_min_bytes=256, cdc_avg_bytes=1024,
             cdc_max_bytes=4096)
COMMITTED = {"pack-flip": 25, "frame-header-flip": 8, "pack-truncate": 10, "pack-delete": 7,
             "manifest-flip": 12, "manifest-truncate": 5}
NOT_COMMITTED = {"orphan-pack-flip": 8, "cache-delete": 7, "cache-flip": 8, "index-record": 10}

VERIFY_CHILD = """
import json, sys
from deltackpt.store import Store
from deltackpt.store.verify import verify_store
r = verify_store(Store.open(sys.argv[1]), level=2)
print(json.dumps({"ok": r.ok, "damaged": r.damaged_checkpoints, "kinds": sorted({p.kind for p in r.problems})}))
"""


def build_template(root: Path) -> dict:
    import numpy as np

    from deltackpt.store import Store, codec
    from deltackpt.store import index as index_mod
    from deltackpt.store.pack import read_pack_entries

    store = Store.init(root, **SMALL)
    rng = np.random.default_rng(12345)
    w = rng.standard_normal(8192).astype(np.float32)
    shared = rng.standard_normal(2048).astype(np.float32)
    for i in range(6):
        w = w.copy()
        w[rng.integers(0, w.size, 40)] += 1.0  # a few changes per checkpoint: deltas
        store.save(f"k{i}", {"w": w, "u": rng.standard_normal(3000).astype(np.float32), "shared": shared,
                             "meta": f"step {i} ".encode() * 50 + rng.bytes(2000)}, metadata={"step": i})
    wr = store.writer()
    wr.add_bytes("orphan", rng.bytes(20_000))
    orphan = set(wr.finish().packs)

    # who depends on which chunk (directly, or through the delta whose base it is)
    users: dict[bytes, set[str]] = {}
    for name in store.checkpoint_names():
        for it in store.read_manifest(name).items:
            for ref in it.chunks:
                users.setdefault(ref.id, set()).add(name)
                e = store.index.lookup(ref.id)
                if e.codec == codec.DELTA:
                    users.setdefault(e.base_id, set()).add(name)
    packs = {}
    for info in store.backend.list("packs/"):
        name = info.key.rsplit("/", 1)[1]
        entries = read_pack_entries(store.backend, name, info.size_bytes)
        packs[name] = {"size": info.size_bytes, "orphan": name in orphan,
                       "entries": [(e.offset, e.offset + 64 + e.stored_len, e.chunk_id, e.codec) for e in entries]}
    index_mod._close_env(root / "cache" / "index.lmdb")
    return {"users": users, "packs": packs, "manifests": store.checkpoint_names()}


def _flip(path: Path, pos: int, bit: int) -> None:
    b = bytearray(path.read_bytes())
    b[pos] ^= 1 << bit
    path.write_bytes(bytes(b))


def inject(kind: str, root: Path, tpl: dict, rnd: random.Random) -> tuple[str, set[str] | None]:
    """Damage ``root``; returns (description, checkpoints that depend on the damaged bytes, or None)."""
    from deltackpt.store import Store
    from deltackpt.store import index as index_mod
    from deltackpt.store.index import encode_record
    from deltackpt.store.pack import pack_key

    users = tpl["users"]
    live = sorted(p for p, v in tpl["packs"].items() if not v["orphan"])
    orphan = sorted(p for p, v in tpl["packs"].items() if v["orphan"])

    def pack_users(p):
        return set().union(*(users.get(cid, set()) for _, _, cid, _ in tpl["packs"][p]["entries"]))

    if kind in ("pack-flip", "orphan-pack-flip"):
        p = rnd.choice(live if kind == "pack-flip" else orphan)
        pos, bit = rnd.randrange(tpl["packs"][p]["size"]), rnd.randrange(8)
        _flip(root / pack_key(p), pos, bit)
        hit = [cid for lo, hi, cid, _ in tpl["packs"][p]["entries"] if lo <= pos < hi]
        where = "chunk" if hit else "structure"
        # A flip in a chunk damages that chunk's users; a flip in the pack's structure (magic, table, footer)
        # puts every user of the pack at risk, and verify reports them all.
        return f"{p}@{pos}.{bit} ({where})", (users.get(hit[0], set()) if hit else pack_users(p))
    if kind == "frame-header-flip":
        cands = [(p, lo) for p in live for lo, _, _, cod in tpl["packs"][p]["entries"] if cod in (1, 2)]
        p, lo = rnd.choice(cands)
        pos, bit = lo + 64 + rnd.randrange(4, 7), rnd.randrange(8)
        _flip(root / pack_key(p), pos, bit)
        cid = next(c for a, _, c, _ in tpl["packs"][p]["entries"] if a == lo)
        return f"{p}@{pos}.{bit}", users.get(cid, set())
    if kind == "pack-truncate":
        p = rnd.choice(live)
        path = root / pack_key(p)
        cut = rnd.randrange(tpl["packs"][p]["size"])
        path.write_bytes(path.read_bytes()[:cut])
        return f"{p} cut at {cut}", pack_users(p)  # without its table no chunk of it can be located
    if kind == "pack-delete":
        p = rnd.choice(live)
        (root / pack_key(p)).unlink()
        return p, pack_users(p)
    if kind in ("manifest-flip", "manifest-truncate"):
        name = rnd.choice(tpl["manifests"])
        path = root / "manifests" / name
        size = path.stat().st_size
        if kind == "manifest-flip":
            pos, bit = rnd.randrange(size), rnd.randrange(8)
            _flip(path, pos, bit)
            return f"{name}@{pos}.{bit}", {name}
        cut = rnd.randrange(size)
        path.write_bytes(path.read_bytes()[:cut])
        return f"{name} cut at {cut}", {name}
    if kind == "cache-delete":
        shutil.rmtree(root / "cache" / "index.lmdb")
        return "cache removed", None
    if kind == "cache-flip":
        data = root / "cache" / "index.lmdb" / "data.mdb"
        size = data.stat().st_size
        flips = [(rnd.randrange(size), rnd.randrange(8)) for _ in range(rnd.randint(1, 4))]
        for pos, bit in flips:
            _flip(data, pos, bit)
        return f"data.mdb flips {flips}", None
    if kind == "index-record":
        store = Store.open(root)
        cid = rnd.choice(sorted(users))
        e = store.index.lookup(cid)
        field = rnd.choice(["offset", "pack", "stored_len", "raw_len", "codec", "short"])
        if field == "short":
            env = store.index.env
            with env.begin(write=True, db=store.index._db[b"chunks"]) as txn:
                txn.put(cid, encode_record(e)[:-3])
        else:
            bad = {"offset": dict(offset=e.offset + rnd.randint(1, 100)), "pack": dict(pack="%032x" % rnd.getrandbits(128)),
                   "stored_len": dict(stored_len=e.stored_len ^ 1), "raw_len": dict(raw_len=e.raw_len + 8),
                   "codec": dict(codec=(e.codec + 1) % 3)}[field]
            store.index.relocate([dataclasses.replace(e, **bad)], {})
        index_mod._close_env(Path(store.cache_dir) / "index.lmdb")
        return f"record of {cid.hex()} field {field}", None
    raise ValueError(kind)


def run_verify(root: Path, isolated: bool) -> dict:
    if isolated:  # a damaged LMDB file may crash the process that maps it
        p = subprocess.run([sys.executable, "-c", VERIFY_CHILD, str(root)], capture_output=True, text=True,
                           cwd=REPO_ROOT, timeout=300, env={"PYTHONPATH": str(REPO_ROOT), "PATH": "/usr/bin:/bin"})
        if p.returncode != 0:
            return {"crashed": f"exit {p.returncode}: {p.stderr[-800:]}"}
        return json.loads(p.stdout)
    from deltackpt.store import Store
    from deltackpt.store import index as index_mod
    from deltackpt.store.verify import verify_store

    store = Store.open(root)
    try:
        r = verify_store(store, level=2)
        return {"ok": r.ok, "damaged": r.damaged_checkpoints, "kinds": sorted({p.kind for p in r.problems})}
    except BaseException as e:  # noqa: BLE001 - verify must never raise on damage; record it
        if isinstance(e, KeyboardInterrupt):
            raise
        return {"crashed": f"{type(e).__name__}: {e}"[:800], "tb": traceback.format_exc()[-800:]}
    finally:
        index_mod._close_env(Path(store.cache_dir) / "index.lmdb")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--injections", type=int, default=200)
    ap.add_argument("--seed", type=int, default=None)
    ap.add_argument("--workdir", default=None)
    ap.add_argument("--max-failures-shown", type=int, default=25)
    args = ap.parse_args(argv)
    sys.path.insert(0, str(REPO_ROOT))

    seed = args.seed if args.seed is not None else random.randrange(2**32)
    rnd = random.Random(seed)
    work = Path(args.workdir or tempfile.mkdtemp(prefix="deltackpt-stress-corrupt-"))
    template = work / "template"
    if template.exists():
        shutil.rmtree(template)
    tpl = build_template(template)
    kinds = {**COMMITTED, **NOT_COMMITTED}
    names, weights = list(kinds), list(kinds.values())

    by_kind = {k: {"injected": 0, "detected" if k in COMMITTED else "clean": 0, "crashed": 0,
                   **({"mapped": 0} if k in COMMITTED else {})} for k in kinds}
    failures, mapping_misses = [], []
    t0 = time.monotonic()
    for n in range(args.injections):
        kind = rnd.choices(names, weights)[0]
        copy = work / "copy"
        if copy.exists():
            shutil.rmtree(copy)
        shutil.copytree(template, copy)
        what, affected = inject(kind, copy, tpl, rnd)
        res = run_verify(copy, isolated=(kind == "cache-flip"))
        st = by_kind[kind]
        st["injected"] += 1
        rec = {"n": n, "kind": kind, "what": what, **res}
        if "crashed" in res:
            st["crashed"] += 1
            failures.append(rec)
            continue
        if kind in COMMITTED:
            if not res["ok"]:
                st["detected"] += 1
                if set(res["damaged"]) == affected:
                    st["mapped"] += 1
                else:
                    mapping_misses.append({**rec, "expected": sorted(affected)})
            else:
                failures.append({**rec, "error": "damage not detected"})
        else:
            if res["ok"]:
                st["clean"] += 1
            else:
                failures.append({**rec, "error": "verify not clean after damage to no committed data"})
        shutil.rmtree(copy, ignore_errors=True)

    committed = sum(by_kind[k]["injected"] for k in COMMITTED)
    detected = sum(by_kind[k]["detected"] for k in COMMITTED)
    other = sum(by_kind[k]["injected"] for k in NOT_COMMITTED)
    clean = sum(by_kind[k]["clean"] for k in NOT_COMMITTED)
    result = {"injections": args.injections, "detected": detected, "committed_damage": committed,
              "not_committed": {"injected": other, "clean": clean},
              "mapped": sum(by_kind[k]["mapped"] for k in COMMITTED), "by_kind": by_kind,
              "failures": failures[:args.max_failures_shown], "num_failures": len(failures),
              "mapping_misses": mapping_misses[:10], "num_mapping_misses": len(mapping_misses),
              "seed": seed, "elapsed_s": round(time.monotonic() - t0, 1)}
    print(json.dumps(result))
    if args.workdir is None:
        shutil.rmtree(work, ignore_errors=True)
    return 0 if detected == committed and clean == other and not failures else 1


if __name__ == "__main__":
    sys.exit(main())

"""Store-level demo: save a few checkpoints of an evolving 'model' and show what the store kept.

A frozen embedding table (never changes), a replicated copy of it (deduplicated), and a few layers that
change every step. Run with `make demo` or `python examples/store_demo.py --store demo-store`.
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

import numpy as np

from deltackpt.cli import main as cli
from deltackpt.errors import DeltackptError
from deltackpt.store import Store
from deltackpt.store.backend import STORE_FOLDERS

MARK = {"made_by": "examples/store_demo.py"}  # in every checkpoint's metadata: what a rerun may delete
STORE_ENTRIES = {"config", "cache", *STORE_FOLDERS}


def remove_previous_demo(path: Path) -> None:
    """Delete ``path`` only if it is a store this demo made (only store entries, every checkpoint marked)."""
    if not path.exists():
        return
    try:
        names = {p.name for p in path.iterdir()}
        store = Store.open(path)
        demo_made = names <= STORE_ENTRIES and all(
            all(i.metadata.get(k) == v for k, v in MARK.items()) for i in store.list_checkpoints())
    except (DeltackptError, OSError):
        demo_made = False
    if not demo_made:
        sys.exit(f"{path} exists and is not a store made by this demo; pass another --store")
    shutil.rmtree(path)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--store", default="demo-store")
    ap.add_argument("--checkpoints", type=int, default=5)
    args = ap.parse_args()

    remove_previous_demo(Path(args.store))
    store = Store.init(args.store)
    rng = np.random.default_rng(0)
    embedding = rng.standard_normal((8192, 256)).astype(np.float32)  # 8 MiB, frozen
    layers = [rng.standard_normal((512, 512)).astype(np.float32) for _ in range(4)]  # 4 MiB, trained
    for step in range(0, args.checkpoints * 100, 100):
        for w in layers:
            w -= 1e-3 * rng.standard_normal(w.shape).astype(np.float32)
        items = {"embedding.weight": embedding, "embedding_copy.weight": embedding}
        items.update({f"layers.{i}.weight": w for i, w in enumerate(layers)})
        items["trainer_state"] = f'{{"step": {step}, "lr": 0.001}}'.encode()
        store.save(f"step-{step}", items, metadata={"step": step, **MARK})

    restored = store.load("latest")
    assert all(np.array_equal(restored[f"layers.{i}.weight"], w) for i, w in enumerate(layers))
    print(f"$ deltackpt ls {args.store}")
    cli(["ls", args.store])
    print(f"\n$ deltackpt du {args.store}")
    cli(["du", args.store])


if __name__ == "__main__":
    main()

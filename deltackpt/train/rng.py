"""Capture and restore every random number generator a training step touches, as DCP-friendly values.

States are tensors and plain ints/floats (no pickled generator objects): Python ``random``, NumPy's
global generator, torch's CPU generator, and every CUDA device's generator when CUDA is present.
"""

from __future__ import annotations

import hashlib
import random
from typing import Any

import numpy as np
import torch


def capture_rng() -> dict[str, Any]:
    version, mt, gauss = random.getstate()
    np_name, np_keys, np_pos, np_has_gauss, np_gauss = np.random.get_state()
    state: dict[str, Any] = {
        "python": {"version": int(version), "mt": torch.tensor(mt, dtype=torch.int64),
                   "gauss": float(gauss) if gauss is not None else None},
        "numpy": {"name": str(np_name), "keys": torch.from_numpy(np.asarray(np_keys, dtype=np.int64).copy()),
                  "pos": int(np_pos), "has_gauss": int(np_has_gauss), "gauss": float(np_gauss)},
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = {str(i): s for i, s in enumerate(torch.cuda.get_rng_state_all())}
    return state


def restore_rng(state: dict[str, Any]) -> None:
    py = state["python"]
    random.setstate((int(py["version"]), tuple(int(x) for x in py["mt"].tolist()), py["gauss"]))
    npst = state["numpy"]
    np.random.set_state((npst["name"], npst["keys"].numpy().astype(np.uint32), int(npst["pos"]),
                         int(npst["has_gauss"]), float(npst["gauss"])))
    torch.set_rng_state(state["torch"].to(torch.uint8).cpu())
    cuda = state.get("cuda")
    if cuda and torch.cuda.is_available():
        n = torch.cuda.device_count()
        for i, s in cuda.items():
            if int(i) < n:
                torch.cuda.set_rng_state(s.to(torch.uint8).cpu(), int(i))


def derived_seed(*parts: Any) -> int:
    """A 63-bit seed that depends only on ``parts`` (stable across processes and runs)."""
    digest = hashlib.sha256(repr(parts).encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


def seed_all(seed: int) -> None:
    """Seed every generator ``capture_rng`` covers (used for ranks that did not exist at save time)."""
    random.seed(seed)
    np.random.seed(seed % (2**32))
    torch.manual_seed(seed)

"""The benchmarks' memory measure: private memory apart from the file pages a process maps."""

from __future__ import annotations

import mmap
import sys

import numpy as np
import pytest

from deltackpt.bench.measure import MiB, PeakRSS

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/status")


def test_private_peak_counts_arrays_and_not_mapped_file_pages(tmp_path):
    path = tmp_path / "f"
    path.write_bytes(b"\1" * (64 * MiB))
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
        with PeakRSS(private=True) as m:
            view = np.frombuffer(mapped, dtype=np.uint8)
            assert int(view[::4096].sum()) == 64 * MiB // 4096  # every page read: mapped into RSS
            del view
        assert m.overhead >= 48 * MiB
        assert m.private_overhead < 16 * MiB
    with PeakRSS(private=True) as m:
        a = np.ones(64 * MiB, dtype=np.uint8)  # every page written: private (held to the end: read at exit)
    assert m.private_overhead >= 48 * MiB and a[-1] == 1

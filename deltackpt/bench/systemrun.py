"""``SystemRun``: one system driven through saves and loads, one measurement per call; ``summarize`` turns
those measurements into the system's result record (what ``results.json`` holds per workload and system).

Shared by the single-process workloads (:mod:`.runner`) and the multi-rank ``reshard`` workload
(:mod:`.reshard`).
"""

from __future__ import annotations

import gc
import os
import statistics
import time

from .measure import PeakRSS, drop_page_cache, warm_tree
from .systems import _barrier, _rank
from .trees import zero_tree

# Each load is timed this many times and the median kept: one 0.1-0.3 s load on a shared 2-core machine
# varies by +-30 % from run to run.
LOAD_REPEATS = 3


class SystemRun:
    """Drive one system through saves and loads, recording a measurement per call."""

    def __init__(self, system, page_cache: str = "warm", load_repeats: int = LOAD_REPEATS) -> None:
        self.system = system
        self.page_cache = page_cache
        self.load_repeats = max(1, int(load_repeats))
        self.saves: list[dict] = []
        self.loads: dict[str, dict] = {}
        self.rss_method = ""
        self.base: dict = {}  # the base saved before the checkpoints, if any: its save time and stored bytes

    def save(self, state: dict, name: str, step: int | None = None) -> dict:
        gc.collect()
        if _rank() == 0:
            os.sync()  # no dirty pages of earlier saves (of this or another system) are flushed during this one
        _barrier()  # and the ranks start together: one rank's time does not include another's collection
        with PeakRSS() as m:
            t0 = time.perf_counter()
            self.system.save(state, name)
            seconds = time.perf_counter() - t0
        m.add_child(self.system.child_peak_bytes)
        self.rss_method = m.method
        rec = {"name": name, "step": step, "save_s": seconds, "peak_rss_bytes": m.peak,
               "rss_overhead_bytes": m.overhead}
        if _rank() == 0:
            rec["stored_bytes"] = self.system.stored_bytes()
        self.saves.append(rec)
        return rec

    def save_base(self, state: dict, name: str = "base") -> None:
        """Save a workload's base before its checkpoints; the checkpoints' stored bytes are counted from here."""
        rec = self.save(state, name)
        self.saves.pop()
        self.base = {"base_save_s": rec["save_s"], "base_stored_bytes": int(rec.get("stored_bytes", 0))}

    def load(self, state: dict, name: str, kind: str) -> dict:
        """Load ``name`` into ``state`` ``load_repeats`` times (zeroed in between, so the last load alone
        fills it); the record keeps the median time and the highest RSS peak."""
        times, peaks, overheads = [], [], []
        for i in range(self.load_repeats):
            if i:
                zero_tree(state)
            cache = self._prepare_cache(name)
            gc.collect()
            with PeakRSS() as m:
                t0 = time.perf_counter()
                self.system.load(state, name)
                times.append(time.perf_counter() - t0)
            m.add_child(self.system.child_peak_bytes)
            self.system.after_load(name)
            peaks.append(m.peak)
            overheads.append(m.overhead)
        rec = {"name": name, "load_s": statistics.median(times), "load_s_all": [round(t, 4) for t in times],
               "peak_rss_bytes": max(peaks), "rss_overhead_bytes": max(overheads), "page_cache": cache}
        self.loads[kind] = rec
        return rec

    def _prepare_cache(self, name: str) -> str:
        how = "warm (files read once before the load)"
        if _rank() == 0:
            if self.page_cache == "drop" and drop_page_cache():  # (which writes dirty pages back first)
                how = "dropped"
            else:
                # Dirty pages of the saves before (gigabytes in a full run) are written back first: a load
                # timed while the kernel flushes them shares the cores with that writeback.
                os.sync()
                for p in self.system.data_paths(name):
                    warm_tree(p)
        _barrier()
        return how

    def result(self) -> dict:
        return summarize(self.saves, self.loads, self.rss_method, {**self.system.extra(), **self.base})


def summarize(saves: list[dict], loads: dict[str, dict], rss_method: str, extra: dict) -> dict:
    """The result record; with ``extra["base_stored_bytes"]`` (a base saved first), stored bytes are what the
    checkpoints added on top of it."""
    times = [r["save_s"] for r in saves]
    before = int(extra.get("base_stored_bytes", 0))
    phases = saves + list(loads.values())
    last, first = loads.get("last", {}), loads.get("first", {})
    out = {
        "stored_bytes": int(saves[-1]["stored_bytes"]) - before if saves else 0,
        "cumulative_bytes": [int(r["stored_bytes"]) - before for r in saves],
        "save_s": sum(times) / len(times) if times else 0.0,
        "save_total_s": sum(times),
        "save_s_per_checkpoint": [round(t, 4) for t in times],
        "load_s": float(last.get("load_s", 0.0)),
        "load_last_s": float(last.get("load_s", 0.0)),
        "load_first_s": float(first.get("load_s", 0.0)),
        "load_last_s_all": list(last.get("load_s_all", [])),
        "load_first_s_all": list(first.get("load_s_all", [])),
        "peak_rss_bytes": int(max((r["peak_rss_bytes"] for r in phases), default=0)),
        "peak_rss_overhead_bytes": int(max((r["rss_overhead_bytes"] for r in phases), default=0)),
        "peak_rss_save_overhead_bytes": int(max((r["rss_overhead_bytes"] for r in saves), default=0)),
        "peak_rss_load_overhead_bytes": int(max((r["rss_overhead_bytes"] for r in loads.values()), default=0)),
        "peak_rss_method": rss_method,
        "page_cache": sorted({r.get("page_cache", "") for r in loads.values()} - {""}),
    }
    out.update(extra)
    return out

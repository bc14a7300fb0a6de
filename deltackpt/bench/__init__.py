"""Workload benchmarks: deltackpt against DCP's FileSystemWriter, ZipNN and restic on real training runs.

Terms
-----
workload
    A seeded training run that yields checkpoints as DCP state dicts (``dense``, ``dense100``, ``frozen``,
    ``sparse``, ``bf16`` in one process; ``reshard`` on 2 then 3 gloo ranks). See :mod:`.workloads`.
system
    A way to store those checkpoints: ``dcp`` (the baseline), ``deltackpt``, ``zipnn``, ``restic``.
    See :mod:`.systems`. Every system gets the very same checkpoints, in order.
ratio vs DCP
    DCP's stored bytes / the system's stored bytes (higher is better). Times and RSS are also reported
    relative to DCP (system / DCP, lower is better), measured in the same run.

``run_bench(out_dir, workloads, size=...)`` runs everything and writes ``results.json``, ``results.md`` and
``cumulative_bytes.png`` (:mod:`.runner`, :mod:`.report`); ``deltackpt bench`` is its command line.
"""

from .runner import run_bench
from .systems import SYSTEMS
from .workloads import FULL_WORKLOADS, QUICK_WORKLOADS, WORKLOADS

__all__ = ["run_bench", "SYSTEMS", "WORKLOADS", "QUICK_WORKLOADS", "FULL_WORKLOADS"]

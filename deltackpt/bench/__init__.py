"""Workload benchmarks: deltackpt against DCP's FileSystemWriter, ZipNN and restic on real training runs.

Terms
-----
workload
    A seeded training run that yields checkpoints as DCP state dicts (``dense``, ``dense100``, ``frozen``,
    ``frozen-base`` (the same with its base model saved first), ``sparse``, ``bf16`` in one process;
    ``reshard`` on 2 then 3 gloo ranks). See :mod:`.workloads`.
system
    A way to store those checkpoints: ``dcp`` (the baseline), ``deltackpt``, ``zipnn``, ``restic``.
    See :mod:`.systems`. Every system gets the very same checkpoints, in order.
ratio vs DCP
    DCP's stored bytes / the system's stored bytes (higher is better). Times and RSS are also reported
    relative to DCP (system / DCP, lower is better), measured in the same run.

``run_bench(out_dir, workloads, size=...)`` runs everything and writes ``results.json``, ``results.md`` and
``cumulative_bytes.png`` (:mod:`.runner`, :mod:`.report`); ``deltackpt bench`` is its command line (parsed in
``deltackpt.cli``; there is no ``python -m deltackpt.bench``).

Modules, each importing only those above it (none imports ``deltackpt.cli``)::

    measure, trees, models    peak RSS / sizes / page cache; state-dict trees; the workloads' models
    systems                   the systems compared, and each one's options for a run
    systemrun                 SystemRun (one system's measured saves and loads) and its result record
    workloads, reshard        the single-process workloads; the multi-rank reshard workload
    report                    results.json, results.md, the cumulative-bytes plot, machine info
    runner                    run_bench, the workload driver and its worker processes

Where the benchmark code lives: the ``deltackpt bench`` command users run, and everything it needs, is this
package. What only the project's own benchmarks need (the DCP and kernel micro-benchmarks, delta bounds,
crash and corruption stress runs, fuzzers, and their helpers in ``_common.py``) lives in ``benchmarks/`` at the
repository root; it imports from here, never the other way round.
"""

from .runner import run_bench
from .systems import SYSTEMS
from .workloads import FULL_WORKLOADS, QUICK_WORKLOADS, WORKLOADS

__all__ = ["run_bench", "SYSTEMS", "WORKLOADS", "QUICK_WORKLOADS", "FULL_WORKLOADS"]

"""The collector pause of the read and write paths lives in the store (:mod:`deltackpt.store.pausegc`)."""

from ..store.pausegc import paused_gc  # noqa: F401 (re-exported for the DCP adapters)

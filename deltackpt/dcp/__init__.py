"""The DCP layer: PyTorch Distributed Checkpoint (``torch.distributed.checkpoint``) on a deltackpt store.

Terms
-----
checkpoint id
    What DCP calls ``checkpoint_id`` is a checkpoint name of the store (:func:`checkpoint_name` validates
    it: no '/', no '..'); for a reader, ``"latest"`` means the newest committed checkpoint.
writer
    :class:`DeltaStorageWriter`, DCP's ``StorageWriter``: every rank writes the chunks of its own write items
    into its own packs; the coordinator (rank 0) commits the checkpoint by writing its manifest in
    ``finish``, with DCP's ``Metadata`` stored under a strict schema (:mod:`.metadata_schema`) in the
    manifest's ``layer_data[LAYER_KEY]``.
reader
    :class:`DeltaStorageReader`, DCP's ``StorageReader``: resolves the checkpoint id, reads its manifest and
    serves each ``ReadItem`` (any box of a saved tensor, so loads reshard) from the store chunks it overlaps.
planner
    :class:`DeltaSavePlanner`, DCP's ``DefaultSavePlanner`` plus a digest of every replicated tensor the rank
    holds (what the replica check compares). The load side uses DCP's default planner.
save plan
    DCP's per-rank ``SavePlan``: the write items a rank will save. Its ``storage_data`` carries this layer's
    per-rank facts to the coordinator (replica digests, host), whose global plan sends back the parent
    checkpoint to diff against, the parent's chunk refs the rank's items overlap (so no rank reads the
    parent's manifest; a one-rank save keeps the coordinator's whole map in the process instead) and how many
    ranks share each machine. A rank's first ``WriteResult`` carries its items (one msgpack list), packs and
    pack entries back to the coordinator.
replica check
    Before anything is written, the coordinator compares the digests of each replicated tensor across
    ranks; differing replicas (a bit flip in memory or compute) raise ``SilentDataCorruptionError``
    (``replica_check="raise"``, the default), log a warning (``"warn"``) or are not compared (``"off"``).

staging buffers
    :class:`StagingBuffers`, where ``dcp.async_save`` copies the state before training goes on (the writer is
    DCP's ``AsyncStager``): allocated once, refilled each save while the state keeps its layout.

``save`` / ``load`` / ``async_save`` (:mod:`.api`) build the writer or reader and raise DCP's wrapped
``CheckpointException`` as the typed deltackpt error (:func:`unwrap`). The layer reaches the engine only
through ``deltackpt.store``'s public names.
"""

from .api import async_save, default_planner, load, quiet_single_process, save, typed_call, typed_future, unwrap
from .names import LAYER_KEY, checkpoint_name
from .planner import DeltaSavePlanner, PlainLoadPlanner
from .reader import DeltaStorageReader
from .staging import StagingBuffers
from .writer import DeltaStorageWriter, check_replica_mode, open_store

__all__ = [
    "LAYER_KEY",
    "DeltaSavePlanner",
    "PlainLoadPlanner",
    "DeltaStorageReader",
    "DeltaStorageWriter",
    "StagingBuffers",
    "async_save",
    "check_replica_mode",
    "checkpoint_name",
    "default_planner",
    "load",
    "open_store",
    "quiet_single_process",
    "save",
    "typed_call",
    "typed_future",
    "unwrap",
]

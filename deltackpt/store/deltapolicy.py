"""The delta decision: whether a changed chunk is stored as a delta, and against which base.

A :class:`DeltaPolicy` answers the writer's questions about one chunk: may it be a delta at all (size,
the store's ``delta`` switch), which base it would be coded against (:meth:`DeltaPolicy.base_for`: the
parent's chunk at the same place if it is a keyframe or a link (a sparse link, :func:`is_sparse_link`; any
delta where the store's ``chain_links`` is "all") and its chain is shorter than ``max_chain``, else that
chunk's own base;
a base is retired when a delta against it would cost more than a new keyframe, and at the latest after
serving ``keyframe_interval`` checkpoints), whether the delta is expected to pay and in which delta codec
(:meth:`DeltaPolicy.verdict`: this place's history, else a sample), and whether a coded delta is small
enough to keep (:meth:`DeltaPolicy.accepts`). The writer codes accordingly. A chain holds at
most ``max_chain`` deltas, so restoring any chunk reads at most ``max_chain + 1`` (with ``max_chain`` 1, a
delta's base is always a keyframe; new stores have 8).

Refresh rule (a renewal rule): a keyframe and the deltas coded against it form a cycle; deltas against an
aging base grow (sparse rows and Adam moments fill in), so the cheapest cycle ends when the next delta costs
more than the cycle's bytes so far per checkpoint: past that line a new keyframe, whose next deltas start
small again, costs less per checkpoint than going on. The index holds all it needs: the stored sizes down
the chain, the parent's delta size and its age (the deltas before it are taken to have grown linearly from
zero, so they total ``last * (age + 1) / 2``). On the bench workloads over 50 checkpoints this stores sparse
in 7 % fewer bytes than retiring bases after 10 checkpoints (18 % at max_chain 8), dense in 0.4 % more
(docs/performance.md).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from ..errors import DeltackptError
from . import codec
from .chunking import as_byte_view
from .pack import HEADER_SIZE, PackEntry, pack_key

_SAMPLE_BYTES = 64 * 1024  # at most; a chunk is judged by a sample of 1/16 of it, at least 16 KiB
_SAMPLE_MIN_CHUNK = 256 * 1024  # smaller chunks are not sampled: their delta is coded outright
# A sample verdict this close to the delta_min_gain line is not trusted. On the bench workloads' fp32 and bf16
# state the sample's delta ratio was mostly within 0.01 of the whole chunk's; where it missed (sparse rows)
# it overrated the delta, which costs a second coding, never bytes.
_SAMPLE_MARGIN = 0.02
# A place whose previous delta came in this far under the line is coded as a delta outright (no sample).
_HISTORY_MARGIN = 0.05
# A chain link costs a restore its bitmaps (1/8 of each plane) and its nonzero bytes, each of its depth: one
# stored in more than 1/32 of its raw size is a leaf. On the bench, sparse's links are stored in 1/49-1/66 of
# their size and chain (12.5x -> 19.5x DCP's bytes); bf16's unchanged weights in 1/13-1/19: chained, they
# stored 2.7 % fewer bytes (2.61x -> 2.68x) but loaded the last checkpoint 1.47x DCP's time.
_LINK_MAX_SHARE = 32
# Chunks smaller than this, or than a quarter of the store's chunk size (biases, norms: a few hundred bytes on
# a sharded model), are always keyframes: a delta would save a few bytes and cost a base lookup, a second
# coding and a cache copy per chunk.
DELTA_MIN_BYTES = 16 * 1024
# The delta codec of a chunk too small to sample (and without this place's history): on the bench workloads'
# checkpoints the zigzag difference came in at most 3 % larger than XOR on any chunk, up to 31 % smaller, and
# 2-13 % smaller on the median chunk (dense, sparse, bf16).
DEFAULT_DELTA_CODEC = codec.ZDELTA


@dataclass(frozen=True)
class DeltaBase:
    """The base (a keyframe, or a delta of a chain) a changed chunk may be coded against."""

    entry: PackEntry  # the base's
    age: int  # checkpoints the base will have served, this one included
    last: int | None  # stored size of the parent's delta at this place (its history), None after a keyframe
    last_codec: int | None = None  # the delta codec of that delta
    depth: int = 0  # deltas in the base's own chain (0: a keyframe); a delta against it has depth + 1
    keyframe_len: int | None = None  # stored size of the keyframe at the bottom of the chain (None: entry's)
    refresh_at: float | None = None  # a delta this large costs more than a new keyframe (the refresh rule)
    packs: frozenset[str] = frozenset()  # the packs of the base and of every link below it (the commit checks them)


class Verdict(NamedTuple):
    """Whether a changed chunk's delta pays (True, False, or None: too close to call) and its delta codec."""

    pays: bool | None
    codec: int


def _sample_prefers_delta(view, base, elem_size: int, level: int, limit_ratio: float,
                          kinds: tuple[int, ...] = (DEFAULT_DELTA_CODEC, codec.DELTA),
                          zdelta_gain: float | None = None) -> Verdict:
    """Whether the chunk's delta will come in under ``limit_ratio`` of its raw size, judged on a sample from
    the chunk's middle (1/16 of it, 16-64 KiB) coded with each delta codec of ``kinds``, and the codec whose
    sample came out smaller; ``pays`` is None when the sample is within ``_SAMPLE_MARGIN`` of the line or the
    chunk too small to sample (then with ``kinds[0]``): then the delta is coded in full and compared.

    ``limit_ratio`` comes from the keyframe at the same place (its coded size, less ``delta_min_gain``), so
    only the delta side is coded: about 12 % of the chunk (6 % per codec), which spares coding a losing delta
    in full. On the bench workloads' deltas (dense, sparse, bf16) the sample picked the smaller codec for 89 %
    of the chunks, a miss cost at most 0.7 % of a chunk, and all picks together came within 0.05 % of the
    smaller codec everywhere.
    """
    n = len(view)
    if n < _SAMPLE_MIN_CHUNK:
        return Verdict(None, kinds[0])
    size = max(16 * 1024, min(_SAMPLE_BYTES, n // 16)) // 64 * 64
    start = (n // 2) // 64 * 64
    part, base_part = view[start:start + size], as_byte_view(base)[start:start + size]
    sizes = {k: len(codec.encode_delta(part, base_part, elem_size, level, k, zdelta_gain)) for k in kinds}
    kind = min(sizes, key=sizes.get)  # the first smallest: a tie keeps kinds[0]
    ratio = sizes[kind] / size
    if ratio <= limit_ratio - _SAMPLE_MARGIN:
        return Verdict(True, kind)
    if ratio >= limit_ratio + _SAMPLE_MARGIN:
        return Verdict(False, kind)
    return Verdict(None, kind)


def _cycle_mean(links: list[PackEntry], deltas: int, last: int) -> float:
    """Stored bytes per checkpoint of a base's cycle so far: ``links`` (the base and its chain down to the
    keyframe, one checkpoint each) and the ``deltas`` coded against the base, the last of ``last`` bytes."""
    spent = sum(e.stored_len for e in links) + last * (deltas + 1) / 2  # deltas grown linearly from zero
    return spent / (len(links) + deltas)


def is_sparse_link(stored, raw_len: int, elem_size: int) -> bool:
    """Whether a delta (its stored bytes) may be the base of another delta: only one stored in at most 1/32 of
    its raw size and applied in place, at the cost of its nonzero bytes (sparse rows). A delta that is a pass
    over the chunk stays a leaf, so restoring any chunk costs its keyframe, the sparse links' nonzero bytes and
    at most one full delta: what max_chain 1 costs plus the sparse links (the bench's dense and bf16 Adam
    moments change everywhere: their deltas never chain)."""
    return len(stored) * _LINK_MAX_SHARE <= raw_len and codec.applies_in_place(stored, raw_len, elem_size)


class DeltaPolicy:
    """The delta decisions of one store's writer (stateless beyond the store's config and index)."""

    def __init__(self, store) -> None:
        self.store = store
        self.config = store.config
        self.min_bytes = min(DELTA_MIN_BYTES, self.config.chunk_size_bytes // 4)

    def may_delta(self, n: int) -> bool:
        """Whether a chunk of ``n`` bytes may be stored as a delta at all."""
        return self.config.delta and n >= self.min_bytes

    def keeps_as_base(self, n: int, is_array: bool) -> bool:
        """Whether a new keyframe of ``n`` bytes is kept in memory as the next save's base."""
        return self.config.delta and is_array and n >= self.min_bytes

    def base_for(self, parent_chunk: bytes, n: int, entry: PackEntry | None = None) -> DeltaBase | None:
        """The base to code a changed chunk of ``n`` bytes against, or None for a new keyframe.

        The base is the parent's chunk at the same place if it is a keyframe or a link (:meth:`is_link`) and
        its chain holds fewer than ``max_chain`` deltas, else that chunk's own base (with ``max_chain`` 1: the
        keyframe behind the parent's chunk), so restoring any chunk reads at most ``max_chain + 1``. A base that has
        served ``keyframe_interval`` checkpoints is retired; before that, a delta is kept only under
        ``refresh_at`` (the refresh rule in the module docstring). The parent's delta size is this place's
        history: a delta that paid off well last time is likely to again.
        """
        entry = entry or self.store.index.lookup(parent_chunk)  # the caller may have looked it up already
        if entry is None or entry.raw_len != n:
            return None
        chain = self._chain(entry, n)
        if chain is None:
            return None  # broken, or longer than this store's max_chain (copied in, or the setting lowered)
        damaged = self.store.index.damaged_packs()
        if damaged and any(e.pack in damaged for e in chain):
            return None  # a base a read found damaged: a new keyframe instead
        depth = len(chain) - 1
        last, last_codec = (entry.stored_len, entry.codec) if codec.is_delta(entry.codec) else (None, None)
        key_len = chain[-1].stored_len
        if depth < self.config.max_chain and (depth == 0 or self.extends_chain(entry)):
            # The parent's chunk is the base: the cycle is the chain so far.
            return DeltaBase(entry, 1, last, last_codec, depth, key_len, _cycle_mean(chain, 0, 0),
                             frozenset(e.pack for e in chain))
        age = entry.age + 1
        if age > self.config.keyframe_interval:
            return None
        return DeltaBase(chain[1], age, last, last_codec, depth - 1, key_len,
                         _cycle_mean(chain[1:], entry.age, entry.stored_len), frozenset(e.pack for e in chain[1:]))

    def is_link(self, stored, raw_len: int, elem_size: int) -> bool:
        """Whether a new delta (its stored bytes) may be the base of the next delta: any delta with the store's
        ``chain_links`` "all", else a sparse link (:func:`is_sparse_link`)."""
        return self.config.chain_links == "all" or is_sparse_link(stored, raw_len, elem_size)

    def extends_chain(self, entry: PackEntry) -> bool:
        """Whether delta ``entry`` may be the base of the next delta (:meth:`is_link`, on its stored bytes read
        from its pack when they are small enough to be sparse)."""
        if self.config.chain_links == "all":
            return True
        if entry.stored_len * _LINK_MAX_SHARE > entry.raw_len:
            return False  # too large to be that sparse: no read needed
        if self.store.base_cache.get(entry.chunk_id) is not None:
            # A writer keeps a delta as the next save's base only when it is a sparse link. (Where two ranks
            # wrote these bytes, the index's copy may be another coding: at worst one full delta in a chain.)
            return True
        try:
            stored = self.store.backend.get_range(pack_key(entry.pack), entry.offset + HEADER_SIZE,
                                                  entry.stored_len)
        except (OSError, DeltackptError):
            return False  # unreadable: no chain grows from it (its bytes are checked where they are read)
        return is_sparse_link(stored, entry.raw_len, entry.elem_size)

    def _chain(self, entry: PackEntry, n: int) -> list[PackEntry] | None:
        """``entry`` and the bases down its chain to a keyframe (one index look-up per delta in it), or None
        when a link is missing or of another size, or the chain holds more than max_chain deltas."""
        chain = [entry]
        while codec.is_delta(entry.codec):
            if len(chain) > self.config.max_chain:
                return None
            entry = self.store.index.lookup(entry.base_id)
            if entry is None or entry.raw_len != n:
                return None
            chain.append(entry)
        return chain

    def _key_limit(self, base: DeltaBase, n: int) -> float:
        # The keyframe's own coded size (the one down the chain, not a delta base's) stands in for this
        # chunk's keyframe coding.
        key_len = base.entry.stored_len if base.keyframe_len is None else base.keyframe_len
        return (1.0 - self.config.delta_min_gain) * min(key_len, n)

    def verdict(self, view, elem_size: int, base: DeltaBase, base_raw) -> Verdict:
        """``pays`` True: code the delta (expected to pay); False: a keyframe (no delta coded); None: too close
        to call, code both ways and keep the smaller (:meth:`accepts` with the keyframe's size); and the delta
        codec to code it with. ``base_raw``: the keyframe's bytes, None when unreadable (a damaged base is
        never built upon)."""
        n = len(view)
        key_limit = self._key_limit(base, n)
        if base_raw is None:
            return Verdict(False, DEFAULT_DELTA_CODEC)
        if base.last is not None and base.refresh_at is not None and base.last >= base.refresh_at:
            return Verdict(False, DEFAULT_DELTA_CODEC)  # deltas against an aging base grow: no need to code it
        if base.last is not None and base.last <= key_limit - _HISTORY_MARGIN * n:
            return Verdict(True, base.last_codec or DEFAULT_DELTA_CODEC)  # this place's last delta paid off well
        # A place with a delta behind it keeps that delta's codec: only the first delta after a keyframe
        # samples both (same bytes on the quick bench; dense's sampling CPU 3.7 -> 2.9 ms a save).
        kinds = (base.last_codec,) if base.last_codec is not None else (DEFAULT_DELTA_CODEC, codec.DELTA)
        return _sample_prefers_delta(view, base_raw, elem_size, self.config.zstd_level, key_limit / n, kinds,
                                     self.zdelta_gain)

    @property
    def zdelta_gain(self) -> float | None:
        """What a zigzag-difference plane must save to be zstd-coded in this store (codec.encode_delta)."""
        return codec.MIN_ZDELTA_PLANE_GAIN_ALL if self.config.chain_links == "all" else None

    def accepts(self, delta_len: int, base: DeltaBase, n: int, keyframe_len: int | None = None) -> bool:
        """Whether a delta of ``delta_len`` bytes is kept for a chunk of ``n`` bytes: at least
        ``delta_min_gain`` under the keyframe's coded size (this chunk's own, ``keyframe_len``, when it was
        coded too; else the base keyframe's), and under ``refresh_at``. A delta larger than its keyframe means
        the place drifted away (e.g. an Adam state filling in): a new keyframe resets the base, so the next
        deltas are small again."""
        if keyframe_len is None:
            limit = self._key_limit(base, n)
        else:
            limit = (1.0 - self.config.delta_min_gain) * keyframe_len
        return delta_len <= limit and (base.refresh_at is None or delta_len < base.refresh_at)

"""The store's ``config`` object: format version, features, store id, chunking and codec defaults.

It is written by ``Store.init`` and read on every open. Its presence is what makes a path a store.

Format gate (restic's repository version is the model): ``format_version`` says how the config itself and the
store's layout are to be read, and ``features`` names every optional encoding a reader must understand to read
the store's data. A reader refuses a store whose version is newer than its own or that lists a feature it
lacks, with :class:`UnsupportedFormatError` naming it, so an older deltackpt never mistakes new data for
damage. Version 1 configs have no ``features`` (readers of version 1 refuse unknown fields); a writer of this
code records its features (and version 2) before it writes any chunk into a store (``with_features``). The
history is in ``docs/format.md``.
"""

from __future__ import annotations

import re
import uuid

import msgspec

from ..errors import ManifestFormatError, UnsupportedFormatError
from .pack import MAX_CHUNK_BYTES

FORMAT_VERSION = 2
CONFIG_KEY = "config"
# The longest chain of deltas any reader follows (feature "delta-chains"); max_chain may not exceed it.
MAX_CHAIN = 64

# Optional encodings this code reads: name -> what a reader must understand (docs/format.md).
SUPPORTED_FEATURES = {
    "plane-container": "codec payloads in a DCPL plane container (per-plane raw / zstd segments)",
    "zero-sparse-planes": "plane segments of mode 2: a bitmap of nonzero bytes plus those bytes",
    "zigzag-delta": "chunks of codec 3 (zdelta): byte planes of the zigzag integer difference with the base",
    "delta-chains": f"a delta's base may itself be a delta, at most {MAX_CHAIN} deltas deep",
    "chain-all-deltas": "config field chain_links: which deltas a writer lets the next delta build on",
}
# What this code's writer may produce in any store it writes to (and "delta-chains" where max_chain > 1).
WRITER_FEATURES = ("plane-container", "zero-sparse-planes", "zigzag-delta")
CHAINS_FEATURE = "delta-chains"
# Listed by a store whose chain_links is not the default, so that a reader that does not know the field
# reports a newer store instead of a config it takes for damaged.
CHAIN_LINKS_FEATURE = "chain-all-deltas"
CHAIN_LINKS = ("sparse", "all")
# Features that name a config field, not an encoding of the data: a copy does not carry them to its
# destination, nor does a recreated config list them (its fields are at their defaults).
CONFIG_FEATURES = frozenset({CHAIN_LINKS_FEATURE})
# Fields added since format 2 was first written, left out of the config at their default so that an older
# reader (which refuses unknown fields) still opens a store that does not use them.
_OMITTED_AT_DEFAULT = {"max_chain": 1, "chain_links": "sparse"}
# What a new store gets. Only deltas applied in place (sparse ones) grow chains (store/deltapolicy.py), so a
# restore costs max_chain 1's plus the sparse links: sparse runs store 19.5x less than DCP (12.5x at 1), dense
# runs the same bytes as at 1 (docs/performance.md, chains). A config without the field (older stores) means 1.
NEW_STORE_MAX_CHAIN = 8

MiB = 1 << 20


class StoreConfig(msgspec.Struct, forbid_unknown_fields=True, frozen=True, kw_only=True):
    """Defaults of one store. Sizes are bytes."""

    format_version: int = FORMAT_VERSION
    # Encodings the store's data may use; every reader must support all of them (sorted, unique).
    features: tuple[str, ...] = ()
    store_id: str = ""
    # Array items: fixed chunks aligned to the item's global byte offset.
    chunk_size_bytes: int = 4 * MiB  # measured: same bytes as 1 MiB, 30-40 % faster loads (deltackpt bench)
    # Opaque byte items: FastCDC.
    cdc_min_bytes: int = 16 * 1024
    cdc_avg_bytes: int = 64 * 1024
    cdc_max_bytes: int = 256 * 1024
    # Packs are sealed once they reach this size.
    pack_target_bytes: int = 32 * MiB
    zstd_level: int = 1
    # A coded chunk is kept only if it is at least this fraction smaller than raw.
    min_gain: float = 0.03
    # Delta coding of changed array chunks against the parent checkpoint's keyframe at the same place.
    delta: bool = True
    # A delta is kept only if it is at least this fraction smaller than the keyframe coding.
    delta_min_gain: float = 0.1
    # A keyframe serves as base for at most this many checkpoints before it is refreshed.
    keyframe_interval: int = 10
    # A delta's base may be a delta this many deltas deep: restoring a chunk reads at most max_chain + 1
    # stored chunks. 1: the base is always a keyframe. Above 1 the store gains the feature "delta-chains".
    max_chain: int = 1
    # Which deltas the next delta may build on. "sparse": only deltas applied in place at restore (sparse
    # rows), so a restore costs max_chain 1's plus their nonzero bytes. "all": any delta, for the fewest bytes
    # (bf16 fine-tune 2.62x -> 2.94x DCP's bytes, dense 1.44x -> 1.50x at max_chain 8) at up to max_chain full
    # delta decodes per chunk (the last checkpoint loaded 1.7-2.7x DCP's time; docs/performance.md, chains).
    chain_links: str = "sparse"

    def validate(self) -> "StoreConfig":
        def bad(msg: str):
            raise ValueError(f"invalid store config: {msg}")

        # Above MAX_CHUNK_BYTES every reader refuses a chunk (and a ref): a save would commit what no load reads.
        if not 4096 <= self.chunk_size_bytes <= MAX_CHUNK_BYTES or self.chunk_size_bytes % 8:
            bad(f"chunk_size_bytes must be in [4096, {MAX_CHUNK_BYTES}] and a multiple of 8, "
                f"got {self.chunk_size_bytes}")
        if not (64 <= self.cdc_min_bytes <= self.cdc_avg_bytes <= self.cdc_max_bytes <= MAX_CHUNK_BYTES):
            bad(f"need 64 <= cdc_min_bytes <= cdc_avg_bytes <= cdc_max_bytes <= {MAX_CHUNK_BYTES}")
        if self.cdc_avg_bytes & (self.cdc_avg_bytes - 1):
            bad("cdc_avg_bytes must be a power of two")
        if self.pack_target_bytes < self.chunk_size_bytes:
            bad("pack_target_bytes must be >= chunk_size_bytes")
        if not (-7 <= self.zstd_level <= 22):
            bad("zstd_level must be in [-7, 22]")
        if not (0.0 <= self.min_gain < 1.0) or not (0.0 <= self.delta_min_gain < 1.0):
            bad("min_gain and delta_min_gain must be in [0, 1)")
        if not (1 <= self.keyframe_interval <= 65535):
            bad("keyframe_interval must be in [1, 65535]")
        if not (1 <= self.max_chain <= MAX_CHAIN):
            bad(f"max_chain must be in [1, {MAX_CHAIN}]")
        if self.chain_links not in CHAIN_LINKS:
            bad(f"chain_links must be one of {', '.join(CHAIN_LINKS)}, got {self.chain_links!r}")
        if self.chain_links != "sparse" and self.max_chain == 1:
            bad(f"chain_links {self.chain_links!r} needs max_chain > 1 (at 1 no delta is a base)")
        # A listed field an older reader does not know must come with the feature that makes it refuse the
        # store by name (it would take the field for damage).
        if self.features and self.chain_links != "sparse" and CHAIN_LINKS_FEATURE not in self.features:
            bad(f"chain_links {self.chain_links!r} needs the feature {CHAIN_LINKS_FEATURE}")
        if list(self.features) != sorted(set(self.features)):
            bad("features must be sorted and unique")
        if self.features and self.format_version < 2:
            bad("features need format_version >= 2")
        return self

    def with_features(self, names) -> "StoreConfig":
        """This config with ``names`` added to its features (and the version that can list them)."""
        features = tuple(sorted(set(self.features) | set(names)))
        if features == self.features:
            return self
        return msgspec.structs.replace(self, features=features, format_version=max(2, self.format_version))


def writer_features(cfg: StoreConfig) -> tuple[str, ...]:
    """The features this code's writer may produce in a store of config ``cfg``."""
    extra = ((CHAINS_FEATURE,) if cfg.max_chain > 1 else ()) + \
        ((CHAIN_LINKS_FEATURE,) if cfg.chain_links != "sparse" else ())
    return tuple(sorted(WRITER_FEATURES + extra))


def data_features(features) -> tuple[str, ...]:
    """Of ``features``, those that name encodings of the data (what a copy of the data needs)."""
    return tuple(sorted(set(features) - CONFIG_FEATURES))


def chain_limit(cfg: StoreConfig) -> int:
    """The most deltas a chain may hold in a store of config ``cfg`` (1: a delta's base is a keyframe)."""
    return MAX_CHAIN if CHAINS_FEATURE in cfg.features else 1


def new_config(**overrides) -> StoreConfig:
    overrides = {"max_chain": NEW_STORE_MAX_CHAIN, **overrides}
    cfg = StoreConfig(store_id=uuid.uuid4().hex, **{k: v for k, v in overrides.items() if k != "features"})
    features = overrides.get("features", writer_features(cfg))
    return msgspec.structs.replace(cfg, features=tuple(features)).validate()


def encode_config(cfg: StoreConfig) -> bytes:
    if not cfg.features and cfg.format_version == 1:
        # A version-1 config is written as version-1 readers expect it: without the features field.
        raw = msgspec.to_builtins(cfg)
        del raw["features"]
        return msgspec.json.format(msgspec.json.encode(raw), indent=2) + b"\n"
    raw = msgspec.to_builtins(cfg)
    for key, default in _OMITTED_AT_DEFAULT.items():
        if raw.get(key) == default:
            del raw[key]
    return msgspec.json.format(msgspec.json.encode(raw), indent=2) + b"\n"


def decode_config(data: bytes) -> StoreConfig:
    # Check the version first so a newer store is reported as such, not as a schema mismatch.
    try:
        raw = msgspec.json.decode(data)
    except (msgspec.DecodeError, RecursionError) as e:  # RecursionError: JSON nested past the stack
        raise ManifestFormatError(f"store config is not valid JSON: {e}") from None
    if not isinstance(raw, dict):
        raise ManifestFormatError("store config must be a JSON object")
    version = raw.get("format_version")
    if type(version) is not int or version < 1:
        raise ManifestFormatError("store config has no valid format_version")
    if version > FORMAT_VERSION:
        raise UnsupportedFormatError(
            f"store format version {version} is newer than this deltackpt supports ({FORMAT_VERSION}); "
            "upgrade deltackpt"
        )
    features = raw.get("features", [])
    if isinstance(features, list):
        unknown = sorted({f for f in features if isinstance(f, str)} - SUPPORTED_FEATURES.keys())
        if unknown:
            raise UnsupportedFormatError(
                f"store uses feature{'s' if len(unknown) > 1 else ''} {', '.join(unknown)} that this deltackpt "
                "does not support; upgrade deltackpt"
            )
    try:
        cfg = msgspec.convert(raw, StoreConfig).validate()
    except (msgspec.ValidationError, ValueError) as e:
        raise ManifestFormatError(f"store config: {e}") from None
    # The id names the local cache directory: it must be exactly what new_config makes.
    if not re.fullmatch(r"[0-9a-f]{32}", cfg.store_id):
        raise ManifestFormatError("store config: store_id must be 32 lowercase hex digits")
    return cfg

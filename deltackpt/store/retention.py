"""Retention: which checkpoints to forget, as a plan first, then its execution; and tags that pin them.

Rules are ORed: a checkpoint is kept if any rule keeps it. ``keep_last`` N newest; ``keep_every`` K keeps
those whose metadata ``step`` (an int; CheckpointManager writes it) is a multiple of K; ``keep_within`` keeps
those created within a duration ("36h", "7d", "2w"); ``keep_tags`` keeps those with a listed tag. A
checkpoint with any tag is never forgotten, and a policy never forgets the newest checkpoint (what a run
resumes from). An empty policy is refused, so a slip cannot forget everything. ``plan_forget_names``
forgets exactly the named checkpoints, refusing tagged ones. Forgetting removes manifests only; ``gc`` then
reclaims chunks nothing else needs.

Tags live in ``tags/<checkpoint>`` (a small JSON list, replaced atomically), outside the immutable manifest.

A tag and a forget of the same checkpoint from two processes: each writes first and checks after. A forget
puts ``forgetting/<id>`` (the names, the time) before it reads the tags, and deletes it when done; a tag
put is followed by a look for such an intent naming its checkpoint (and for the manifest): if one is there,
the tag is taken back and refused. Whatever the order, a checkpoint is either kept or its tag refused, never
forgotten with a tag its writer was told it has; a refused tag leaves the tags that were there before it. A
forget renews its intent while it removes manifests, so a slow one stays covered. An intent a crash left
behind stops counting after ``INTENT_TTL_S`` (hosts' clocks are assumed to agree within minutes), and the
next forget deletes it once it is older than ``STALE_INTENT_S``. Where a full disk leaves no room for the
intent, the forget goes on without it (it is how such a disk gets space back) and logs the checkpoints it
removed that were tagged meanwhile.
"""

from __future__ import annotations

import json
import logging
import re
import time
import uuid
from dataclasses import dataclass, field

from ..errors import CheckpointNotFoundError, CheckpointPinnedError, DiskFullError
from .location import describe
from .manifest import validate_name

FORGETTING_PREFIX = "forgetting/"
log = logging.getLogger("deltackpt.retention")
INTENT_TTL_S = 600.0  # a forget's intent older than this is a crashed forget's: it no longer refuses tags
STALE_INTENT_S = 6 * INTENT_TTL_S  # a crashed forget's intent older than this is deleted by the next forget
FORGET_BATCH = 256  # manifests removed between two looks at the intent's age (renewed after INTENT_TTL_S / 3)

_DURATION = re.compile(r"(\d+(?:\.\d+)?)([smhdw])")
_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}
_TAG_RE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._+=@-]{0,63}")


def parse_duration(text: str) -> float:
    """Seconds in "90s", "15m", "36h", "7d", "2w" (or a sum like "1d12h")."""
    pos, total = 0, 0.0
    for m in _DURATION.finditer(text):
        if m.start() != pos:
            break
        total += float(m.group(1)) * _UNITS[m.group(2)]
        pos = m.end()
    if pos != len(text) or not text:
        raise ValueError(f"invalid duration {text!r}: use e.g. 90s, 15m, 36h, 7d, 2w")
    return total


def _tag_key(name: str) -> str:
    return f"tags/{validate_name(name)}"


# What a tags object that does not read holds in its place: not a valid tag (set_tags drops it), so it never
# reaches a store, and still a pin (forget keeps the checkpoint) until `tag` rewrites the object.
DAMAGED_TAGS = "(damaged)"


def read_tags(store, name: str) -> list[str]:
    """Checkpoint ``name``'s tags; ``[DAMAGED_TAGS]`` when its tags object does not read."""
    try:
        data = store.backend.get(_tag_key(name))
    except FileNotFoundError:
        return []
    return _decode_tags(name, data)


def read_all_tags(store) -> dict[str, list[str]]:
    """Tags of every tagged checkpoint (one listing, then one read per tagged checkpoint)."""
    out = {}
    for info in store.backend.list("tags/"):
        name = info.key[len("tags/"):]
        try:
            out[name] = _decode_tags(name, store.backend.get(info.key))
        except FileNotFoundError:
            continue  # untagged since the listing
    return out


def _decode_tags(name: str, data: bytes) -> list[str]:
    try:
        tags = json.loads(data)
    except (ValueError, RecursionError):
        return [DAMAGED_TAGS]
    if not isinstance(tags, list) or not all(isinstance(t, str) and _TAG_RE.fullmatch(t) for t in tags):
        return [DAMAGED_TAGS]  # also a tag no writer makes (a flipped bit): it still pins, and verify says so
    return tags


def set_tags(store, name: str, tags: list[str]) -> list[str]:
    """Replace the tags of checkpoint ``name`` (which must exist); an empty list removes them. A damaged tags
    object (read as ``DAMAGED_TAGS``) is replaced."""
    store.resolve(name)
    tags = [t for t in tags if t != DAMAGED_TAGS]
    for t in tags:
        if not _TAG_RE.fullmatch(t):
            raise ValueError(f"invalid tag {t!r}: 1-64 letters, digits and . _ + = @ -")
    tags = sorted(set(tags))
    if tags:
        key = _tag_key(name)
        try:
            before = store.backend.get(key)
        except FileNotFoundError:
            before = None
        store.backend.put(key, json.dumps(tags).encode())
        forgetting = _being_forgotten(store, name)
        exists = store.exists(name)
        if forgetting or not exists:  # a forget raced this tag: see the module's docstring
            if before is not None and exists:
                # Only this change is refused: the tags there before passed this same check, so a forget naming
                # the checkpoint wrote its intent after them, saw them, and keeps it. Deleting them would unpin it.
                store.backend.put(key, before)
            else:
                store.backend.delete(key)
            raise CheckpointNotFoundError(name, reason="a forget running in another process is removing it; "
                                          "not tagged (tag it again once that forget is done)"
                                          if forgetting else "forgotten while it was being tagged")
    else:
        store.backend.delete(_tag_key(name))
    return tags


def _being_forgotten(store, name: str) -> bool:
    """Whether a running forget (an intent younger than ``INTENT_TTL_S``) names checkpoint ``name``."""
    now = time.time()
    for info in store.backend.list(FORGETTING_PREFIX):
        try:
            intent = json.loads(store.backend.get(info.key))
        except (FileNotFoundError, ValueError, RecursionError):
            continue  # done since the listing, or not an intent a forget wrote
        if (isinstance(intent, dict) and isinstance(intent.get("time"), (int, float))
                and isinstance(intent.get("names"), list) and now - intent["time"] < INTENT_TTL_S
                and name in intent["names"]):
            return True
    return False


@dataclass
class ForgetPlan:
    store: object
    keep: dict[str, list[str]] = field(default_factory=dict)  # name -> reasons
    forget: list[str] = field(default_factory=list)

    def as_dict(self) -> dict:
        return {"keep": [{"name": n, "reasons": r} for n, r in self.keep.items()], "forget": self.forget}

    def execute(self) -> list[str]:
        """Remove the manifests (and tags) of the planned checkpoints; returns the names removed. A checkpoint
        tagged since the plan was made (``deltackpt tag`` from another process) is kept instead."""
        if not self.forget:
            return []
        intent = f"{FORGETTING_PREFIX}{uuid.uuid4().hex}"  # before the tags are read: see the module's docstring
        written = self._put_intent(intent)
        try:
            now_tagged = {i.key[len("tags/"):] for i in self.store.backend.list("tags/")}  # one listing
            tagged = [n for n in self.forget if n in now_tagged]  # a pin set after the plan read the tags
            for name in tagged:
                self.forget.remove(name)
                self.keep[name] = ["tagged since the plan"]
            removed = []
            for start in range(0, len(self.forget), FORGET_BATCH):
                if written is not None and time.time() - written > INTENT_TTL_S / 3:
                    # Renewed while manifests are still to go: a slow forget (many names on object storage)
                    # must not outlive its intent, or a tag racing the rest would be accepted, then deleted.
                    written = self._put_intent(intent)
                # one index transaction per batch, not one per checkpoint
                removed += self.store.forget(self.forget[start:start + FORGET_BATCH])
            if written is None:
                self._note_late_tags(now_tagged, removed)
            for name in self.forget:
                self.store.backend.delete(_tag_key(name))
        finally:
            self.store.backend.delete(intent)
        _drop_stale_intents(self.store)
        return removed

    def _put_intent(self, key: str) -> float | None:
        """Write (or renew) this forget's intent; its time, or None where the disk has no room for it."""
        now = time.time()
        try:
            self.store.backend.put(key, json.dumps({"names": self.forget, "time": now}).encode())
            return now
        except DiskFullError:
            # forget is how a full disk gets its space back (with gc): it goes on without the intent, and a tag
            # written after the tags were listed and checked before its manifest went is lost (warned below)
            log.warning("%s: no room for a forget's intent; forgetting without it (a tag set meanwhile on a "
                        "checkpoint it removes is lost)", describe(self.store.backend))
            return None

    def _note_late_tags(self, listed: set[str], removed: list[str]) -> None:
        """Without an intent, name the removed checkpoints tagged after the tags were listed: their tagger may
        have been told they were tagged."""
        try:
            late = sorted({i.key[len("tags/"):] for i in self.store.backend.list("tags/")} & set(removed) - listed)
        except OSError:
            return
        if late:
            log.warning("%s: tagged while being forgotten without an intent, and removed: %s",
                        describe(self.store.backend), ", ".join(late))


def _drop_stale_intents(store) -> None:
    """Delete intents crashed forgets left (written over ``STALE_INTENT_S`` ago by the listing's clock): they
    stopped counting after ``INTENT_TTL_S`` already, so this changes no decision, only what lies in the store.
    Best effort: a forget that did its work never fails for its cleanup."""
    now = time.time()
    try:
        for info in store.backend.list(FORGETTING_PREFIX):
            if info.mtime_s and now - info.mtime_s > STALE_INTENT_S:
                store.backend.delete(info.key)
    except OSError as e:
        log.warning("%s: left old forget intents in place: %s", describe(store.backend), e)


def plan_forget(store, *, keep_last: int | None = None, keep_every: int | None = None,
                keep_within: str | float | None = None, keep_tags: list[str] | None = None,
                now: float | None = None, select=None) -> ForgetPlan:
    if keep_last is None and keep_every is None and keep_within is None and not keep_tags:
        raise ValueError("refusing an empty retention policy: give at least one of keep_last, keep_every, "
                         "keep_within, keep_tags")
    if keep_last is not None and keep_last < 1 or keep_every is not None and keep_every < 1:
        raise ValueError("keep_last and keep_every must be >= 1 (to forget everything, use forget by name)")
    within_s = parse_duration(keep_within) if isinstance(keep_within, str) else keep_within
    if within_s is not None and within_s <= 0:
        raise ValueError(f"keep_within must be longer than 0, got {keep_within!r}: it keeps checkpoints created "
                         "within that long (to forget checkpoints, use forget by name)")
    now = time.time() if now is None else now
    infos = store.list_checkpoints()  # oldest first
    if select is not None:  # ``select(name)``: the checkpoints the policy is about; it leaves the others alone
        infos = [info for info in infos if select(info.name)]
    steps = [_step(info) for info in infos]
    if keep_every is not None and infos and all(s is None for s in steps):
        # Counting positions instead would keep different checkpoints each time forget runs.
        raise ValueError(f"keep_every uses the checkpoint metadata field 'step' (an int, written by "
                         f"CheckpointManager or save(..., metadata={{'step': N}})), and none of the "
                         f"{len(infos)} checkpoint(s) has one; use keep_last or keep_within instead")
    all_tags = read_all_tags(store)
    plan = ForgetPlan(store=store)
    for pos, (info, step) in enumerate(zip(infos, steps)):
        reasons = []
        age_rank = len(infos) - pos  # 1 = newest
        if keep_last is not None and age_rank <= keep_last:
            reasons.append(f"last {keep_last}")
        if keep_every is not None and step is not None and step % keep_every == 0:
            reasons.append(f"every {keep_every}")
        if within_s is not None and now - info.created_ns / 1e9 <= within_s:
            reasons.append(f"within {keep_within}")
        tags = all_tags.get(info.name)
        if tags:
            listed = [t for t in tags if keep_tags and t in keep_tags]
            reasons.append(f"tag {','.join(listed or tags)}")
        if not reasons and age_rank == 1:
            reasons.append("newest")  # what a run resumes from; forget it by name if really meant
        if reasons:
            plan.keep[info.name] = reasons
        else:
            plan.forget.append(info.name)
    return plan


def plan_forget_names(store, names: list[str]) -> ForgetPlan:
    """Forget exactly ``names`` (``latest`` = the newest). Refuses, before anything changes, a name that does
    not exist (CheckpointNotFoundError with nearby names) and a tagged checkpoint (CheckpointPinnedError)."""
    if not names:
        raise ValueError("give at least one checkpoint name to forget")
    plan = ForgetPlan(store=store)
    seen: set[str] = set()  # (a look in plan.forget per name was quadratic: 16,000 names took 1.3 s)
    for name in names:
        resolved = store.resolve(name)
        tags = read_tags(store, resolved)
        if tags:
            raise CheckpointPinnedError(resolved, tags)
        if resolved not in seen:
            seen.add(resolved)
            plan.forget.append(resolved)
    return plan


def _step(info) -> int | None:
    step = info.metadata.get("step") if isinstance(info.metadata, dict) else None
    return step if isinstance(step, int) and not isinstance(step, bool) else None

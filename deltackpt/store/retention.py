"""Retention: which checkpoints to forget, as a plan first, then its execution; and tags that pin them.

Rules are ORed: a checkpoint is kept if any rule keeps it. ``keep_last`` N newest; ``keep_every`` K keeps
those whose step (user metadata ``step``, else their position) is a multiple of K; ``keep_within`` keeps
those created within a duration ("36h", "7d", "2w"); ``keep_tags`` keeps those with a listed tag. A
checkpoint with any tag is never forgotten. An empty policy is refused, so a slip cannot forget everything.
Forgetting removes manifests only; ``gc`` then reclaims chunks nothing else needs.

Tags live in ``tags/<checkpoint>`` (a small JSON list, replaced atomically), outside the immutable manifest.
"""

from __future__ import annotations

import json
import re
import time
from dataclasses import dataclass, field

from ..errors import ManifestFormatError
from .faults import crash_point
from .manifest import validate_name

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


def read_tags(store, name: str) -> list[str]:
    try:
        data = store.backend.get(_tag_key(name))
    except FileNotFoundError:
        return []
    try:
        tags = json.loads(data)
    except ValueError:
        raise ManifestFormatError(f"tags of {name!r} are not valid JSON") from None
    if not isinstance(tags, list) or not all(isinstance(t, str) for t in tags):
        raise ManifestFormatError(f"tags of {name!r} must be a list of strings")
    return tags


def set_tags(store, name: str, tags: list[str]) -> list[str]:
    """Replace the tags of checkpoint ``name`` (which must exist); an empty list removes them."""
    store.resolve(name)
    for t in tags:
        if not _TAG_RE.fullmatch(t):
            raise ValueError(f"invalid tag {t!r}: 1-64 letters, digits and . _ + = @ -")
    tags = sorted(set(tags))
    if tags:
        store.backend.put(_tag_key(name), json.dumps(tags).encode())
    else:
        store.backend.delete(_tag_key(name))
    return tags


@dataclass
class ForgetPlan:
    store: object
    keep: dict[str, list[str]] = field(default_factory=dict)  # name -> reasons
    forget: list[str] = field(default_factory=list)

    def as_dict(self) -> dict:
        return {"keep": [{"name": n, "reasons": r} for n, r in self.keep.items()], "forget": self.forget}

    def execute(self) -> list[str]:
        """Remove the manifests (and tags) of the planned checkpoints; returns the names removed."""
        removed = []
        for name in self.forget:
            crash_point("forget:before-delete")
            removed += self.store.forget([name])
            self.store.backend.delete(_tag_key(name))
        return removed


def plan_forget(store, *, keep_last: int | None = None, keep_every: int | None = None,
                keep_within: str | float | None = None, keep_tags: list[str] | None = None,
                now: float | None = None) -> ForgetPlan:
    if keep_last is None and keep_every is None and keep_within is None and not keep_tags:
        raise ValueError("refusing an empty retention policy: give at least one of keep_last, keep_every, "
                         "keep_within, keep_tags")
    if keep_last is not None and keep_last < 1 or keep_every is not None and keep_every < 1:
        raise ValueError("keep_last and keep_every must be >= 1 (to forget everything, use forget by name)")
    within_s = parse_duration(keep_within) if isinstance(keep_within, str) else keep_within
    now = time.time() if now is None else now
    infos = store.list_checkpoints()  # oldest first
    plan = ForgetPlan(store=store)
    for pos, info in enumerate(infos):
        reasons = []
        age_rank = len(infos) - pos  # 1 = newest
        if keep_last is not None and age_rank <= keep_last:
            reasons.append(f"last {keep_last}")
        step = info.metadata.get("step", pos) if isinstance(info.metadata, dict) else pos
        if keep_every is not None and isinstance(step, int) and step % keep_every == 0:
            reasons.append(f"every {keep_every}")
        if within_s is not None and now - info.created_ns / 1e9 <= within_s:
            reasons.append(f"within {keep_within}")
        tags = read_tags(store, info.name)
        if tags:
            listed = [t for t in tags if keep_tags and t in keep_tags]
            reasons.append(f"tag {','.join(listed or tags)}")
        if reasons:
            plan.keep[info.name] = reasons
        else:
            plan.forget.append(info.name)
    return plan

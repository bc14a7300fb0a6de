"""What an error of ``torch.load(weights_only=True)`` means: a value it may not unpickle, or a damaged file.

torch wraps every failure of its weights-only unpickler in one ``pickle.UnpicklingError`` whose message
opens with advice (re-run with ``weights_only=False``, in bold ANSI escapes) and ends with a link; the line
that says what went wrong is :func:`refusal_reason`. :func:`is_unsafe` tells a refused global, class or
function (the file asks for more than plain data: refused for safety) from a stream the unpickler cannot
parse (an unknown opcode, a truncated string: the file is damaged, nothing about it is unsafe). Torch-free.
"""

from __future__ import annotations

import pickle
import re

_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_MARKER = "WeightsUnpickler error:"
_DOCS = "Check the documentation of torch.load"
# torch's refusals of what a pickle asks for (torch/_weights_only_unpickler.py): an unsupported or blocked
# GLOBAL, a reduce of a function not allowed, a class not allowlisted, a type needing a module imported first.
_UNSAFE = re.compile(r"\bGLOBAL\b|allowlisted|add_safe_globals|is blocked|unrecognized function|must be imported")


def refusal_reason(e: BaseException) -> str:
    """The line of a weights-only load error that says what went wrong, without torch's advice or escapes."""
    text = _ANSI.sub("", str(e)).split(_DOCS)[0]
    if _MARKER in text:
        text = text.split(_MARKER, 1)[1]
    lines = [line.strip().removeprefix("Weights only load failed.").strip() for line in text.splitlines()]
    # torch's advice (re-run with weights_only=False, file an issue) names weights_only; the reason does not
    lines = [line for line in lines if line and "weights_only" not in line]
    reason = lines[0] if lines else type(e).__name__
    return reason.split(" Please use ")[0][:200]  # (the rest of "Unsupported global" is how to allowlist it)


def is_unsafe(reason: str) -> bool:
    """Whether ``reason`` (:func:`refusal_reason`) refuses something the pickle asks for, not damage."""
    return _UNSAFE.search(reason) is not None


def describe_load_error(e: BaseException) -> str:
    """A load error in one line: the weights-only reason, or the exception's type and first line."""
    if isinstance(e, pickle.UnpicklingError):
        return refusal_reason(e)
    kind = type(e).__qualname__ if type(e).__module__ == "builtins" else f"{type(e).__module__}.{type(e).__qualname__}"
    lines = [line.strip() for line in _ANSI.sub("", str(e)).splitlines() if line.strip()]
    return f"{kind}: {lines[0][:200]}" if lines else kind

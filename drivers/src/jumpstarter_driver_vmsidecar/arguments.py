"""The arguments of the drivers' exported calls, checked where they arrive. A lease holder sends
any JSON (``"nan"``, ``[1]``, ``1e308``, a dict for a string) whatever the stock client would: a
wrong one must be a ``ValueError`` naming it (the client's ``DriverInvalidArgument``), never a
``TypeError`` from deep inside a call, nor a wait that never ends."""

from __future__ import annotations

from typing import Any

#: the longest wait any call takes (a day): a lease is not meant to outlive it
MAX_WAIT_S = 86400.0


def seconds(value: Any, name: str = "timeout", *, maximum: float = MAX_WAIT_S) -> float:
    """``value``, a JSON number of seconds in ``[0, maximum]``, as a float.

    :raise ValueError: not a number (a string such as ``"inf"`` is not, nor a bool), NaN, negative, or
        past ``maximum``.
    """
    if isinstance(value, int | float) and not isinstance(value, bool) and 0 <= value <= maximum:
        return float(value)  # (NaN fails every comparison)
    raise ValueError(f"{name} must be a number of seconds from 0 to {maximum:g}; got {value!r:.100}")


def seconds_or_none(value: Any, name: str = "timeout") -> float | None:
    """:func:`seconds`, or None (no deadline: until the call is cancelled or the lease ends)."""
    return None if value is None else seconds(value, name)


def text(value: Any, name: str) -> str:
    """``value``, which must be a string.

    :raise ValueError: naming ``name`` and the type received.
    """
    if not isinstance(value, str):
        raise ValueError(f"{name} must be a string, not {type(value).__name__} {value!r:.80}")
    return value

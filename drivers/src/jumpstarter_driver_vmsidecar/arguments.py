"""The arguments of the drivers' exported calls, checked where they arrive. A lease holder sends
any JSON (``"nan"``, ``[1]``, ``1e308``, a dict for a string) whatever the stock client would: a
wrong one must be a ``ValueError`` naming it (the client's ``DriverInvalidArgument``), never a
``TypeError`` from deep inside a call, nor a wait that never ends."""

from __future__ import annotations

from typing import Any

from vmsidecar_contract.endpoints import MAX_WAIT_S, is_wait


def seconds(value: Any, name: str = "timeout", *, least: float = 0.0) -> float:
    """``value``, a JSON number of seconds in ``[least, MAX_WAIT_S]`` (the contract's ``is_wait``), as a float.

    :raise ValueError: not a number (a string such as ``"inf"`` is not, nor a bool), NaN, below
        ``least``, or past a day.
    """
    if is_wait(value) and value >= least:
        return float(value)
    raise ValueError(f"{name} must be a number of seconds from {least:g} to {MAX_WAIT_S:g}; got {value!r:.100}")


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

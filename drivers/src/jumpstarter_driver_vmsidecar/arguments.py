"""The arguments of the drivers' exported calls, checked where they arrive. A lease holder sends
any JSON (``"nan"``, ``[1]``, ``1e308``, a dict for a string) whatever the stock client would: a
wrong one must be a ``ValueError`` naming it (the client's ``DriverInvalidArgument``), never a
``TypeError`` from deep inside a call, nor a wait that never ends."""

from __future__ import annotations

from typing import Any

from vmsidecar_contract.endpoints import MAX_WAIT_S, is_wait

#: periodic sends kept on one CAN bus at once, started or not: each holds its frames for as long as
#: it is kept, and once started a thread of the exporter (slcan) or a timer of the host's kernel
#: (native), whose threads and memory serve every lease; a task made with ``autostart=False`` is
#: kept as long as a running one (15,000 frames a call had grown the exporter by ~20 MiB a call)
MAX_PERIODIC_SENDS = 64
#: frames one periodic send cycles through
MAX_PERIODIC_FRAMES = 256
#: the shortest period of a periodic send: python-can takes any float, and microseconds flood the bus
MIN_PERIOD_S = 0.001


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


def periodic_send(msgs: Any, period: Any, duration: Any, *, kept: int, channel: object) -> tuple[float, float | None]:
    """The period and duration of a periodic send of ``msgs`` (a list or tuple of frames, or one)
    on the CAN bus ``channel``, which keeps ``kept`` periodic sends already.

    One check for the exported ``Can._send_periodic_internal`` and our python-can bus: a lease
    holder calls the former with any JSON, and the latter is a python-can interface of its own.

    :raise ValueError: ``MAX_PERIODIC_SENDS`` are kept already, more than ``MAX_PERIODIC_FRAMES``
        frames, a period not from ``MIN_PERIOD_S`` to a day, a duration not up to a day.
    """
    room_for_periodic_send(kept, channel)
    frames = len(msgs) if isinstance(msgs, list | tuple) else 1
    if frames > MAX_PERIODIC_FRAMES:
        raise ValueError(f"a periodic send cycles through at most {MAX_PERIODIC_FRAMES} frames, not {frames}")
    return seconds(period, "period", least=MIN_PERIOD_S), seconds_or_none(duration, "duration")


def room_for_periodic_send(kept: int, channel: object) -> None:
    """:raise ValueError: the CAN bus ``channel`` keeps ``MAX_PERIODIC_SENDS`` periodic sends already."""
    if kept >= MAX_PERIODIC_SENDS:
        raise ValueError(f"{MAX_PERIODIC_SENDS} periodic sends are already kept on the CAN bus {channel} "
                         "(started or not): stop one (CanClient: task.stop()) before making another")

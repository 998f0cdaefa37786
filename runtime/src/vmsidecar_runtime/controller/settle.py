"""When a freshly booted guest has settled: the moment its snapshot is captured.

A readiness marker comes when the guest says it is up, not when it is done: a systemd guest goes
on starting units (the serial getty's login and shell, utmp, timers) for seconds after
``multi-user.target`` (the Debian guest under TCG: ~3 s at a whole core). A snapshot taken at the
marker makes every restore replay that tail: under TCG ~100,000 blocks of guest code translated
again (the whole 64 MiB translation cache of every restored instance) and the first shell command
answered 2.8 s after the restore; taken once the guest has settled, ~23,000 blocks (13 MB) and 0.2 s
(docs/performance.md, "the capture waits for the guest to settle").

So a capturing boot is Ready at its marker, and the capture waits until the guest's vCPUs have
been idle for ``QUIET_WINDOWS`` windows in a row, or until something wants the guest (a claim, any
operation: they wait for the capture's pause, not for the settling), or ``settle_limit()``.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Callable

log = logging.getLogger(__name__)

#: how often the vCPUs' time is read
SETTLE_WINDOW_S = 0.25
#: a window in which the vCPUs ran less than this share of one core is quiet (an idle Linux guest:
#: 0-4 % under TCG; booting: 85-100 %)
QUIET_SHARE = 0.2
#: this many quiet windows in a row (2 s): settled. The Debian guest's tail has quiet gaps: with
#: 0.75 s of quiet it was captured 2.0 s after its marker and its first command after a recycle took
#: 1.3 s; with 2 s, captured 5 s after, 0.42 s (docs/performance.md)
QUIET_WINDOWS = 8
#: the longest a capture waits for its guest to settle (a guest that never idles is captured then)
SETTLE_LIMIT_S = 30.0
#: overrides ``SETTLE_LIMIT_S`` (seconds; 0 captures at the marker, as before 2026-11-27)
SETTLE_ENV = "VMSIDECAR_CAPTURE_SETTLE_S"

#: why a capture's wait ended (``SnapshotInfo.captured_when``)
SETTLED, REQUESTED, LIMIT, AT_READY = "settled", "requested", "settle_limit", "at_ready"


def settle_limit() -> float:
    """The longest a capture waits for its guest to settle, in seconds (0: it does not wait)."""
    raw = os.environ.get(SETTLE_ENV)
    if raw is None:
        return SETTLE_LIMIT_S
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not 0 <= value <= 3600:
        log.warning("%s=%r is not a number of seconds from 0 to 3600; using %.0f", SETTLE_ENV, raw, SETTLE_LIMIT_S)
        return SETTLE_LIMIT_S
    return value


async def until_settled(vcpu_seconds: Callable[[], float | None], limit: float, wanted: list[asyncio.Event], *,
                        waiting: Callable[[], None] = lambda: None) -> str:
    """Wait until the guest settled (``SETTLED``), one of ``wanted`` is set (``REQUESTED``) or
    ``limit`` seconds passed (``LIMIT``). ``vcpu_seconds``: the CPU time the guest's vCPUs used so
    far; None when it cannot be read (``AT_READY``: no wait, or none any longer). ``waiting`` is
    called once, before the wait, when there is one."""
    last = vcpu_seconds() if limit > 0 else None
    if last is None:
        return AT_READY
    waiting()
    loop = asyncio.get_running_loop()
    deadline, quiet = loop.time() + limit, 0
    waits = [asyncio.ensure_future(event.wait()) for event in wanted]
    try:
        while True:
            started = loop.time()
            window = min(SETTLE_WINDOW_S, max(deadline - started, 0))
            if not waits:
                await asyncio.sleep(window)
            elif (await asyncio.wait(waits, timeout=window, return_when=asyncio.FIRST_COMPLETED))[0]:
                return REQUESTED
            now, used = loop.time(), vcpu_seconds()
            if used is None:
                return AT_READY
            quiet = quiet + 1 if (used - last) < QUIET_SHARE * max(now - started, 1e-3) else 0
            last = used
            if quiet >= QUIET_WINDOWS:
                return SETTLED
            if now >= deadline:
                return LIMIT
    finally:
        for wait in waits:
            wait.cancel()

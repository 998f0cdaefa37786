"""Child processes: one way to start them, so the PID-1 reaper knows which ones are ours."""

from __future__ import annotations

import asyncio
from typing import Any

#: pids started through ``spawn`` and not yet waited for; the reaper leaves these to asyncio
OWN: set[int] = set()


async def spawn(*argv: str, **kwargs: Any) -> asyncio.subprocess.Process:
    """``asyncio.create_subprocess_exec`` (list exec, never a shell) that records the pid."""
    proc = await asyncio.create_subprocess_exec(*argv, **kwargs)
    OWN.add(proc.pid)
    wait = proc.wait

    async def tracked_wait() -> int:
        try:
            return await wait()
        finally:
            OWN.discard(proc.pid)

    proc.wait = tracked_wait  # type: ignore[method-assign]
    return proc

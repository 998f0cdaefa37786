"""Child processes: one way to start them, so the PID-1 reaper knows which ones are ours."""

from __future__ import annotations

import asyncio
import ctypes
import signal
import subprocess
import sys
from typing import Any

#: pids started through ``spawn`` and not yet waited for; the reaper leaves these to asyncio
OWN: set[int] = set()


def _die_with_parent() -> None:  # pragma: no cover - runs in the child between fork and exec
    # PR_SET_PDEATHSIG(SIGKILL): a QEMU must never outlive the runtime that owns its disk and sockets
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)


async def spawn(*argv: str, die_with_parent: bool = False, **kwargs: Any) -> asyncio.subprocess.Process:
    """``asyncio.create_subprocess_exec`` (list exec, never a shell) that records the pid.

    ``die_with_parent`` makes the kernel kill the child when the runtime dies, however it dies.
    """
    if die_with_parent and sys.platform == "linux":
        kwargs["preexec_fn"] = _die_with_parent
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


def run(*argv: str) -> tuple[int, str, str]:
    """Run a helper program to completion from a worker thread: ``(rc, stdout, stderr)``.

    The pid is recorded like :func:`spawn`'s, because the PID-1 reaper would otherwise collect
    the child first and ``subprocess`` would then report a failed ``qemu-img check`` as rc 0.

    :raise FileNotFoundError: when the program is not installed.
    """
    proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    OWN.add(proc.pid)
    try:
        out, err = proc.communicate()
    finally:
        OWN.discard(proc.pid)
    return proc.returncode, out.decode(errors="replace"), err.decode(errors="replace")

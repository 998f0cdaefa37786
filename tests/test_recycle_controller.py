"""Both recycle strategies through two real lease cycles: `jmp run` (0.9.0, controller mode)
against the in-test controller (tests/jmpctl), the runtime, and a real guest."""

from __future__ import annotations

import asyncio
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest

from fixtures.jmp import PIPE_UNTIL, VM_TYPE
from fixtures.waiting import wait_until_async
from vmsidecar_contract.client import RuntimeClient
from vmsidecar_contract.state import VmState

pytestmark = pytest.mark.timeout(900)


LEASE_ONE = PIPE_UNTIL + r"""
j vm power on
pipe_until 'VMSIDECAR-READY' boot1.txt
pipe_until 'secret-2-written' work1.txt '\necho lease1-secret > /data/secret; sync; (sleep 7777 &); echo secret-$((1+1))-written\n'
"""

LEASE_TWO = PIPE_UNTIL + r"""
j vm power on
pipe_until 'check-4-done' check2.txt '\nls /data/secret; ps | grep -c "[s]leep 7777"; echo check-$((2+2))-done\n'
"""


def _shell(lease: Any, script: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(lease.argv("bash", "-c", f"set -euo pipefail\ncd {cwd}\n{script}"), env=lease.env,
                          capture_output=True, text=True, timeout=300)


async def test_in_place_reuse_two_leases_are_isolated(
    start_runtime: Any, tiny_image: Any, jmpctl: Any, tmp_path: Path
) -> None:
    rt = await start_runtime({"image": f"file:{tiny_image.disk}", "memory": "256M"})
    await rt.client().wait_ready(180)
    cfg = jmpctl.exporter_config({"vm": {"type": VM_TYPE, "config": {"socket": str(rt.socket),
                                                                       "recycle": "InPlaceReuse"}}})
    exporter = jmpctl.start_exporter(cfg)
    await asyncio.to_thread(jmpctl.wait_status, "vm", "AVAILABLE", 60)

    with jmpctl.lease("vm") as lease:
        result = await asyncio.to_thread(_shell, lease, LEASE_ONE, tmp_path)
        assert result.returncode == 0, result.stderr[-3000:] + jmpctl.log_text(exporter)[-3000:]
    released = lease.released_at
    available = await asyncio.to_thread(jmpctl.wait_status, "vm", "AVAILABLE", 60, released)
    async with RuntimeClient(rt.socket) as client:

        async def recycled() -> VmState | None:
            state = await client.state()
            return state if state.generation == 1 and state.phase.value == "Ready" else None

        # 0.9.0 reports AVAILABLE first, then closes lease 1's drivers (→ recycle)
        state = await wait_until_async(recycled, 180, "lease 1's recycle to be Ready", interval=0.1,
                                       detail=lambda: jmpctl.log_text(exporter)[-3000:])
        ready = time.monotonic()
        assert not state.claimed, jmpctl.log_text(exporter)[-3000:]

    with jmpctl.lease("vm") as lease:
        result = await asyncio.to_thread(_shell, lease, LEASE_TWO, tmp_path)
        assert result.returncode == 0, result.stderr[-3000:] + jmpctl.log_text(exporter)[-3000:]
    check = (tmp_path / "check2.txt").read_text(errors="replace")
    assert "lease1-secret" not in check  # no byte of lease 1's console output
    assert "No such file or directory" in check  # lease 1's file is gone
    lines = [line.strip() for line in check.replace("\r", "").splitlines()]
    assert "0" in lines and "1" not in lines  # and so is its process
    assert exporter.poll() is None  # InPlaceReuse: the exporter stays for the next lease
    print(f"InPlaceReuse: release→AVAILABLE {available - released:.2f} s, release→guest Ready {ready - released:.2f} s")


async def test_exit_and_replace_ends_exporter_and_runtime_with_0(
    start_runtime: Any, tiny_image: Any, jmpctl: Any, tmp_path: Path
) -> None:
    rt = await start_runtime({"image": f"file:{tiny_image.disk}", "memory": "256M"})
    await rt.client().wait_ready(180)
    cfg = jmpctl.exporter_config({"vm": {"type": VM_TYPE, "config": {"socket": str(rt.socket)}}})
    exporter = jmpctl.start_exporter(cfg)
    await asyncio.to_thread(jmpctl.wait_status, "vm", "AVAILABLE", 60)

    with jmpctl.lease("vm") as lease:
        result = await asyncio.to_thread(_shell, lease, "j vm power on\nj vm power read", tmp_path)
        assert result.returncode == 0, result.stderr[-3000:] + jmpctl.log_text(exporter)[-3000:]
    released = lease.released_at
    exporter_rc = await asyncio.to_thread(exporter.wait, 60)
    exporter_exit = time.monotonic()
    runtime_rc = await asyncio.to_thread(rt.proc.wait, 60)
    runtime_exit = time.monotonic()
    assert exporter_rc == 0, jmpctl.log_text(exporter)[-3000:]  # not restarted: the pod completes Succeeded
    assert runtime_rc == 0, rt.log_text()[-3000:]
    assert "AVAILABLE" not in [s for t, s in jmpctl.status_log("vm") if t > released]  # never offered again
    print(f"ExitAndReplace: release→exporter exit {exporter_exit - released:.2f} s, "
          f"release→runtime exit {runtime_exit - released:.2f} s")

"""Storage bounds (issue 19, item 8): a guest that fills the state volume, a cache over its budget.

A lease holder controls what the guest writes; a pool admin controls what the cache is given. The
guest's writes land in the lease's overlay in the state directory: when they no longer fit, the
guest must stop with a clear error (not fill the node); the image cache holds what a budget
allows and evicts the least recently used, never what a VM uses.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from fixtures.faults import tmpfs, wait_phase
from guestio import Console

pytestmark = pytest.mark.timeout(600)


async def test_a_guest_that_fills_the_state_volume_is_paused_with_a_clear_error(
    start_runtime: Any, tiny_image: Any, tmp_path: Path
) -> None:
    # 16 MiB of state; the guest writes 48 MiB of random data to its 64 MiB /data partition
    with tmpfs(tmp_path / "state", "16m") as state_dir:
        rt = await start_runtime({"image": f"file:{tiny_image.disk}", "memory": "256M", "snapshot": "off"},
                                 extra_args=["--state-dir", str(state_dir)])
        client = rt.client()
        await client.wait_ready(240)
        con = await Console.open(rt.shared / "console.sock")
        await con.wake()
        con.writer.write(b"dd if=/dev/urandom of=/data/fill bs=1M count=48 conv=fsync; echo DD-ENDED\n")
        await con.writer.drain()
        state = await wait_phase(client, "Error", "Stopped", "Crashed", timeout=120)
        message = (state.last_error or {}).get("message", "")
        print(f"guest dd into a 16 MiB state volume: {state.phase.value}: {message}")
        assert state.phase.value == "Error", state
        assert message.startswith("the state volume is full"), message
        assert str(state_dir) in message and "recycle" in message, message
        assert b"DD-ENDED" not in con.seen  # the guest never saw its write fail: it was stopped
        await con.close()

        # recovery: the recycle drops the overlay (and its space); the guest is back, pristine
        await client.recycle()
        state = await client.wait_ready(240)
        assert state.phase.value == "Ready" and state.last_error is None, state
        await rt.client().power("off", graceful=False)
        rt.stop()

"""The guest clock after a memory-snapshot restore: a restored guest resumes at the capture
instant; with a guest agent the runtime sets its clock to the host's before Ready, without one it
says so (and the restore stays as fast)."""

from __future__ import annotations

import asyncio
import re
import time
from pathlib import Path
from typing import Any

import pytest

from fixtures.images import DEBIAN_FAST_CPU
from vmsidecar_contract.client import RuntimeClient
from vmsidecar_images.console import Console

pytestmark = pytest.mark.timeout(900)

#: how long the guest sits in the cache before the recycle: its clock would be this far behind
BEHIND_S = 20.0
#: how far the corrected clock may be from the host's (agent round trip, console, TCG load)
CLOCK_SLACK_S = 5.0


@pytest.fixture
def image_cache(tmp_path: Path) -> Path:
    """A cache of this test's own (overrides the session's, which every xdist worker shares): these
    tests read, compare or damage the cache's entries, and another worker's captures would be among them."""
    return tmp_path / "cache"


async def _guest_clock(console_sock: Path) -> tuple[float, float, float, float]:
    """Host time before, the guest's wall clock and uptime, host time after."""
    con = await Console.open(console_sock)
    try:
        await con.drain_replay()
        await con.wake()
        before = time.time()
        out = await con.run("echo CLOCK $(date +%s.%N) $(cut -d' ' -f1 /proc/uptime)")
        after = time.time()
    finally:
        await con.close()
    m = re.search(r"CLOCK ([0-9.]+) ([0-9.]+)", out)
    assert m, out
    return before, float(m.group(1)), float(m.group(2)), after


async def _recycle(client: RuntimeClient) -> tuple[Any, float]:
    started = time.monotonic()
    await client.recycle()
    state = await client.wait_ready(120, poll=0.02)
    return state, time.monotonic() - started


async def test_debian_guest_clock_is_corrected_after_a_restore(start_runtime: Any, debian_image: Any) -> None:
    # a channel no other test's spec has: a snapshot key of its own, so this first boot captures
    rt = await start_runtime({"image": f"file:{debian_image.disk}", "memory": "1G", "cpu": DEBIAN_FAST_CPU,
                                "channels": [{"name": "clock"}]})
    client = rt.client()
    await client.wait_ready(600)
    first = await client.wait_stored()  # the capture is stored just after Ready
    assert first.snapshot.boot == "cold" and first.snapshot.available, first.snapshot
    # the capture found the agent, and the captured boot continuing from the snapshot had its clock set
    assert first.snapshot.clock == "corrected", first.snapshot
    _, _, uptime_at_capture, captured_at = await _guest_clock(rt.shared / "console.sock")

    await asyncio.sleep(BEHIND_S)  # host time must pass for the snapshot's clock to fall behind: the point
    state, seconds = await _recycle(client)
    assert state.snapshot.boot == "restored" and state.snapshot.clock == "corrected", state.snapshot
    assert seconds < 30, f"restore + clock took {seconds:.1f} s"
    before, guest_now, uptime_now, after = await _guest_clock(rt.shared / "console.sock")
    assert before - CLOCK_SLACK_S <= guest_now <= after + CLOCK_SLACK_S, (before, guest_now, after)
    # the fix matters: the restored guest lived only seconds since the capture (its uptime is the
    # snapshot's), while the host lived over BEHIND_S; its own clock would be that far behind
    guest_lived, host_lived = uptime_now - uptime_at_capture, after - captured_at
    print(f"\nguest lived {guest_lived:.1f} s, host {host_lived:.1f} s; recycle -> Ready {seconds:.2f} s; "
          f"guest clock - host clock {guest_now - (before + after) / 2:+.2f} s")
    assert host_lived - guest_lived >= BEHIND_S - CLOCK_SLACK_S, (guest_lived, host_lived)


async def test_a_guest_without_agent_restores_as_fast_and_says_so(start_runtime: Any, tiny_image: Any,
                                                                  image_cache: Path) -> None:
    spec = {"image": f"file:{tiny_image.disk}", "memory": "256M", "channels": [{"name": "clock-tiny"}]}
    rt = await start_runtime(spec)
    client = rt.client()
    await client.wait_ready(240)
    first = await client.wait_stored()
    assert first.snapshot.boot == "cold" and first.snapshot.available, first.snapshot
    assert first.snapshot.clock == "no guest agent", first.snapshot
    state, seconds = await _recycle(client)
    assert state.snapshot.boot == "restored" and state.snapshot.clock == "no guest agent", state.snapshot
    assert seconds < 10, f"a restore took {seconds:.1f} s"  # ~0.15 s unloaded: no agent, no wait

    # a snapshot without the capture's findings (an older layout) is not used: a cold boot, with
    # the reason, captures a complete one
    metas = [p / "meta.json" for p in (image_cache / "snapshots").iterdir() if (p / "meta.json").is_file()]
    newest = max(metas, key=lambda p: p.stat().st_mtime)
    newest.unlink()
    state, _ = await _recycle(client)
    assert state.snapshot.boot == "cold" and "captures one" in (state.snapshot.reason or ""), state.snapshot
    assert state.snapshot.clock == "no guest agent", state.snapshot  # the captured boot goes on restored
    assert (await client.wait_stored()).snapshot.available
    assert newest.is_file(), "the cold boot captured the snapshot again"
    state, _ = await _recycle(client)
    assert state.snapshot.boot == "restored" and state.snapshot.clock == "no guest agent", state.snapshot

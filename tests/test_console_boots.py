"""Console scrollback, first-byte time and readiness belong to one boot: after power off/on, a
reset or a guest reboot, a reader never gets an earlier boot's output (the tiny guest's marker
carries the kernel's random boot_id, so a stale marker cannot pass for a fresh one)."""

from __future__ import annotations

import asyncio
import re
from pathlib import Path
from typing import Any

import pytest

from fixtures.vmdev import vm_client, vm_runtime
from fixtures.waiting import wait_until_async
from vmsidecar_contract.client import RuntimeClient
from vmsidecar_images.console import Console

pytestmark = pytest.mark.timeout(600)

MARKER = rb"VMSIDECAR-READY image=\S+ uptime=\S+ boot=([0-9a-f-]{36})"


async def _fresh_marker(client: RuntimeClient, console_sock: Path, earlier: list[bytes], boot: int) -> bytes:
    """Connect right after a power operation: the replay holds nothing of an earlier boot, and the
    marker that arrives is this boot's."""
    state = await client.state()
    assert state.boot == boot and state.timings.ready is None, state
    con = await Console.open(console_sock)
    try:
        match = await con.expect(MARKER, 120)
        for old in earlier:
            assert old not in con.seen, "the console replayed an earlier boot"
        assert match.group(1) not in earlier
        state = await client.wait_ready(60)
        assert state.boot == boot and state.timings.ready is not None
        assert state.timings.first_console_byte is not None
        # 0.0 happens: after a reset, SeaBIOS's first bytes can be read within 0.5 ms of the boot's start
        assert 0 <= state.timings.first_console_byte <= state.timings.ready
        return match.group(1)
    finally:
        await con.close()


async def test_every_boot_has_its_own_scrollback(start_runtime: Any, tiny_image: Any) -> None:
    rt = await start_runtime({"image": f"file:{tiny_image.disk}", "memory": "256M"})
    client = rt.client()
    state = await client.wait_ready(180)
    assert state.boot == 1
    cable = await Console.open(rt.shared / "console.sock")  # stays connected throughout, like a cable
    first = (await cable.expect(MARKER, 30)).group(1)
    seen = [first]

    await client.power("off", graceful=False)
    await client.power("on")
    seen.append(await _fresh_marker(client, rt.shared / "console.sock", seen, boot=2))
    await cable.expect(re.escape(seen[-1]), 30)  # the long-lived reader saw the new boot live

    await client.power("reset")
    seen.append(await _fresh_marker(client, rt.shared / "console.sock", seen, boot=3))

    # (no `cycle` here: it is the same off then on, test_faults_process.py cycles a real guest)
    # the guest reboots itself: QEMU's RESET (not ours) starts boot 4
    await cable.wake()
    cable.writer.write(b"reboot -f\n")
    await cable.writer.drain()

    async def booted() -> bool:
        return (await client.state()).boot == 4

    await wait_until_async(booted, 30, "boot 4", interval=0.1)
    seen.append(await _fresh_marker(client, rt.shared / "console.sock", seen, boot=4))
    assert len(set(seen)) == 4
    await cable.close()


def test_driver_console_after_power_cycle_is_the_new_boot(tiny_image: Any, tmp_path: Path, image_cache: Path) -> None:
    spec = {"image": f"file:{tiny_image.disk}", "memory": "256M"}
    with vm_runtime(spec, tmp_path / "rt", image_cache) as rt, vm_client(rt, spec) as client:
        with client.console.pexpect() as p:
            p.expect(MARKER.decode(), timeout=60)
            first = p.match.group(1)
        client.power.off()
        client.power.on()
        with client.console.pexpect() as p:
            p.expect(MARKER.decode(), timeout=120)
            second = p.match.group(1)
            assert first not in p.before
        assert second != first

        async def state() -> Any:
            async with RuntimeClient(rt.socket) as c:
                return await c.wait_ready(60)

        assert asyncio.run(state()).boot == 2

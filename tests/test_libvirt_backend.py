"""The libvirt backend against a daemon the runtime does not own (``libvirt_uri`` in the spec)."""

from __future__ import annotations

import subprocess
import tempfile
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from fixtures.runtime import _libvirt_problem

pytestmark = [pytest.mark.timeout(300),
              pytest.mark.skipif(_libvirt_problem() is not None, reason=str(_libvirt_problem()))]


@pytest.fixture
async def libvirt_daemon() -> AsyncIterator[Any]:
    """A libvirtd started by the test (the same private, namespaced kind the runtime starts)."""
    from vmsidecar_runtime.libvirt.daemon import PrivateDaemon

    root = Path(tempfile.mkdtemp(prefix="vmsidecar-lv-"))
    daemon = PrivateDaemon(root / "libvirt")
    await daemon.start()
    yield daemon
    await daemon.stop()
    subprocess.run(["rm", "-rf", str(root)], check=False)


def _domains(uri: str) -> list[str]:
    out = subprocess.run(["virsh", "-c", uri, "list", "--all", "--name"], capture_output=True, text=True,
                         timeout=30, check=True).stdout
    return [line.strip() for line in out.splitlines() if line.strip()]


async def test_external_uri_boot_power_and_exit_leave_the_daemon_alone(
    start_runtime: Any, tiny_image: Any, libvirt_daemon: Any
) -> None:
    rt = await start_runtime({"image": f"file:{tiny_image.disk}", "memory": "256M",
                              "libvirt_uri": libvirt_daemon.uri}, backend="libvirt")
    client = rt.client()
    state = await client.wait_ready(180)
    assert state.backend == "libvirt" and rt.libvirt_uri() == libvirt_daemon.uri
    assert "private libvirtd" not in rt.log_text()  # it used ours, it did not start its own
    [domain] = _domains(libvirt_daemon.uri)
    assert domain.startswith("vmsidecar-")
    state = await client.power("off", graceful=True, timeout=60)
    assert state.phase.value == "Stopped" and _domains(libvirt_daemon.uri) == []
    await client.power("on")
    await client.wait_ready(180)
    assert _domains(libvirt_daemon.uri) == [domain]
    assert rt.stop() == 0
    assert _domains(libvirt_daemon.uri) == []  # the guest is gone, the daemon (not the runtime's) still answers
    assert libvirt_daemon.proc.returncode is None


async def test_guest_powering_itself_off_is_stopped_and_leaves_no_domain(start_runtime: Any, tiny_image: Any) -> None:
    from guestio import Console

    rt = await start_runtime({"image": f"file:{tiny_image.disk}", "memory": "256M"}, backend="libvirt")
    client = rt.client()
    await client.wait_ready(180)
    assert len(rt.virsh_domains()) == 1
    con = await Console.open(rt.shared / "console.sock")
    await con.wake()
    seen: list[tuple[str, Any]] = []

    async def collect() -> None:
        async for event in client.events(["qemu.shutdown", "qemu.exited", "phase"]):
            seen.append((event["type"], event["data"].get("reason") or event["data"].get("phase")))
            if event["type"] == "phase" and event["data"].get("phase") == "Stopped":
                return

    import asyncio

    task = asyncio.create_task(collect())
    await asyncio.sleep(0.2)
    con.writer.write(b"poweroff -f\n")
    await con.writer.drain()
    await asyncio.wait_for(task, 60)
    await con.close()
    assert ("qemu.shutdown", "guest-shutdown") in seen, seen
    state = await client.state()
    assert state.phase.value == "Stopped" and state.last_error is None
    assert rt.virsh_domains() == []

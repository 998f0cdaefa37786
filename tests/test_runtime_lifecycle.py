"""The runtime on a real guest (QEMU, TCG here): boot, power, crash, recycle, SIGTERM."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
from pathlib import Path
from typing import Any

import pytest

from fixtures.events import collecting
from fixtures.faults import wait_phase
from fixtures.runtime import BACKENDS
from fixtures.waiting import wait_until_async
from vmsidecar_contract.client import RuntimeClient
from vmsidecar_contract.errors import GenerationChangedError
from vmsidecar_images.console import Console
from vmsidecar_runtime.oci import push_artifact

pytestmark = pytest.mark.timeout(600)


def _spec(image: str, **extra: Any) -> dict[str, Any]:
    return {"image": image, "memory": "256M", **extra}


@pytest.mark.parametrize("backend", BACKENDS)
async def test_registry_boot_without_exporter_graceful_and_hard_off(
    start_runtime: Any, tiny_image: Any, registry: Any, backend: str
) -> None:
    ref = f"{registry.host}/vm/tiny:lifecycle"
    push_artifact(tiny_image.disk, ref)
    rt = await start_runtime(_spec(ref), backend=backend)
    client = rt.client()
    state = await client.wait_ready(180)  # nobody asked: the runtime pulls and boots on its own
    assert state.backend == backend
    assert state.accel in ("tcg", "kvm") and state.accel_reason
    assert state.image_digest and state.timings.ready and state.timings.ready < 120
    hvc0 = await Console.open(rt.shared / "hvc0.sock")
    await hvc0.expect("VMSIDECAR-READY image=tiny")  # the marker on the second console too

    # graceful off: the guest sees the ACPI power button and shuts itself down
    async with collecting(client, ["guest.powerdown_requested", "guest.powered_off", "phase"]) as events:
        state = await client.power("off", graceful=True, timeout=60)
        assert state.phase.value == "Stopped"
        await events.wait_for("guest.powered_off", 60)
    kinds = [(e["type"], e["data"].get("reason")) for e in events]
    assert ("guest.powerdown_requested", None) in kinds
    assert ("guest.powered_off", "guest-shutdown") in kinds, kinds

    # hard off: no ACPI, QEMU is simply ended
    await client.power("on")
    await client.wait_ready(180)
    async with collecting(client, ["guest.powerdown_requested", "phase"]) as events:
        state = await client.power("off", graceful=False)
        assert state.phase.value == "Stopped"
        await events.wait_for(lambda e: e["type"] == "phase" and e["data"]["phase"] == "Stopped", 60)
    assert "guest.powerdown_requested" not in [e["type"] for e in events], events.kinds()  # no ACPI asked
    await hvc0.close()
    if backend == "libvirt":
        assert rt.virsh_domains() == []  # transient: an off domain is gone from libvirt


@pytest.mark.parametrize("backend", BACKENDS)
async def test_disk_survives_power_cycle_but_not_recycle(start_runtime: Any, tiny_image: Any, backend: str) -> None:
    rt = await start_runtime(_spec(f"file:{tiny_image.disk}"), backend=backend)
    client = rt.client()
    await client.wait_ready(180)
    if backend == "libvirt":
        assert len(rt.virsh_domains()) == 1
    con = await Console.open(rt.shared / "console.sock")
    await con.wake()
    await con.run("echo lease-one-was-here > /data/marker; sync")
    assert "lease-one-was-here" in await con.run("cat /data/marker")
    await con.close()

    state = await client.power("cycle")  # a power cycle keeps the disk, like a real board
    assert state.generation == 0
    await client.wait_ready(180)
    con = await Console.open(rt.shared / "console.sock")
    await con.wake()
    assert "lease-one-was-here" in await con.run("cat /data/marker")
    await con.close()

    state = await client.recycle()
    assert state.generation == 1
    await client.wait_ready(180)
    con = await Console.open(rt.shared / "console.sock")
    await con.drain_replay()
    assert b"VMSIDECAR-READY" in con.seen  # the new boot's scrollback is replayed …
    assert b"lease-one-was-here" not in con.seen  # … and none of the old generation's
    await con.wake()
    out = await con.run("cat /data/marker 2>&1; ls /data")
    assert "No such file" in out and "lease-one-was-here" not in out
    await con.close()
    base = Path(str(tiny_image.disk))
    assert not os.access(base, os.W_OK) or base.stat().st_mode & 0o222 == 0  # the base was never writable
    if backend == "libvirt":
        assert len(rt.virsh_domains()) == 1  # the fresh boot only: recycle left no domain behind
        await client.recycle(boot=False)
        assert rt.virsh_domains() == []


@pytest.mark.parametrize("backend", BACKENDS)
async def test_qemu_killed_is_crashed_then_power_on_recovers(
    start_runtime: Any, tiny_image: Any, qemu_processes: Any, backend: str
) -> None:
    rt = await start_runtime(_spec(f"file:{tiny_image.disk}"), backend=backend)
    client = rt.client()
    await client.wait_ready(180)
    pids = [p for p in os.listdir("/proc") if p.isdigit() and _cmdline_has(p, str(rt.state))]
    assert len(pids) == 1
    os.kill(int(pids[0]), signal.SIGKILL)
    state = await wait_phase(client, "Crashed", timeout=10)
    if backend == "qemu":
        assert state.last_exit and state.last_exit.signal == signal.SIGKILL
    else:  # libvirt reports why the domain stopped, not QEMU's exit status
        assert state.last_exit and "domain stopped" in state.last_error["message"]  # type: ignore[index]
    assert state.last_error and "power on again to recover" in state.last_error["message"]
    await client.power("on")
    await client.wait_ready(180)
    assert qemu_processes(str(rt.state)) == 1
    if backend == "libvirt":
        # destroyed behind the runtime's back (virsh destroy) is a crash too, and power on recovers
        [domain] = rt.virsh_domains()
        await asyncio.to_thread(subprocess.run, ["virsh", "-c", rt.libvirt_uri(), "destroy", domain], check=True,
                                capture_output=True, timeout=30)
        state = await wait_phase(client, "Crashed", timeout=10)
        assert state.phase.value == "Crashed" and "destroyed" in state.last_error["message"]  # type: ignore[index]
        await client.power("on")
        await client.wait_ready(180)
        assert rt.virsh_domains() == [domain] and qemu_processes(str(rt.state)) == 1


@pytest.mark.parametrize("backend", BACKENDS)
async def test_concurrent_power_requests_never_start_two_qemus(
    start_runtime: Any, tiny_image: Any, qemu_processes: Any, backend: str
) -> None:
    spec = _spec(f"file:{tiny_image.disk}", backend=backend)
    rt = await start_runtime(None, extra_args=["--allow-host-paths", str(tiny_image.disk.parent)])
    client = rt.client()
    await client.put_spec(spec)
    results = await asyncio.gather(*(client.power(a) for a in ["on", "on", "cycle", "on", "on"]),
                                   return_exceptions=True)
    assert not [r for r in results if isinstance(r, BaseException)], results
    assert qemu_processes(str(rt.state)) == 1
    await client.wait_ready(180)
    assert qemu_processes(str(rt.state)) == 1


@pytest.mark.parametrize("backend", BACKENDS)
async def test_sigterm_stops_guest_and_runtime_cleanly(
    start_runtime: Any, tiny_image: Any, qemu_processes: Any, backend: str
) -> None:
    rt = await start_runtime(_spec(f"file:{tiny_image.disk}"), backend=backend)
    await rt.client().wait_ready(180)
    assert qemu_processes(str(rt.state)) == 1
    if backend == "libvirt":
        assert len(rt.virsh_domains()) == 1
        daemon_root = rt.libvirt_uri().split("socket=")[1].removesuffix("/run/libvirt-sock")
    rc = await asyncio.to_thread(rt.stop, signal.SIGTERM, 60)
    assert rc == 0, rt.log_text()[-2000:]
    assert qemu_processes(str(rt.state)) == 0
    assert sorted(p.name for p in rt.shared.iterdir()) == []  # api.sock, console sockets and lock removed
    if backend == "libvirt":  # the private libvirtd is gone with the runtime, its files too
        assert not any(daemon_root.encode() in _cmdline(p) for p in os.listdir("/proc") if p.isdigit())
        assert not Path(daemon_root).exists()


async def test_second_runtime_on_same_shared_dir_is_refused(start_runtime: Any) -> None:
    first = await start_runtime(None, name="first")
    second = await start_runtime(None, name="second", wait=False,
                                 extra_args=["--shared-dir", str(first.shared)])
    rc = await asyncio.to_thread(second.proc.wait, 30)
    assert rc == 2
    assert "another vmsidecar runtime" in second.log_text() and "--shared-dir" in second.log_text()
    async with RuntimeClient(first.socket) as c:
        assert await c.healthy()


def _cmdline(pid: str) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def _cmdline_has(pid: str, needle: str) -> bool:
    try:
        cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False
    return os.path.basename(cmd.split(b"\0")[0]).startswith(b"qemu-system") and needle.encode() in cmd


async def test_claim_recycles_a_used_generation_and_late_recycle_is_a_no_op(
    start_runtime: Any, tiny_image: Any
) -> None:
    """0.9.0 may open lease N+1's drivers before lease N's close() ran: the claim covers that order."""
    rt = await start_runtime(_spec(f"file:{tiny_image.disk}"))
    client = rt.client()
    await client.wait_ready(180)
    first = await client.claim()
    assert (first.generation, first.claimed) == (0, True)
    second = await client.claim()  # the next lease claims before the previous one recycled
    assert (second.generation, second.claimed) == (1, True)
    with pytest.raises(GenerationChangedError):
        await client.recycle(if_generation=0)  # the previous lease's late recycle must not wipe lease 2
    state = await client.wait_ready(180)
    assert state.generation == 1 and state.claimed


@pytest.mark.parametrize("backend", BACKENDS)
async def test_runtime_killed_takes_its_qemu_along(
    start_runtime: Any, tiny_image: Any, qemu_processes: Any, backend: str
) -> None:
    """Even SIGKILL (no cleanup code runs) must not leave a QEMU holding the disk and sockets.

    With libvirt: PDEATHSIG ends unshare, --kill-child its namespace init, the kernel the rest.
    """
    rt = await start_runtime(_spec(f"file:{tiny_image.disk}"), backend=backend)
    await rt.client().wait_ready(180)
    assert qemu_processes(str(rt.state)) == 1
    daemon_root = rt.libvirt_uri().split("socket=")[1].removesuffix("/run/libvirt-sock") if backend == "libvirt" else ""
    rt.proc.kill()
    rt.proc.wait(10)
    await wait_until_async(lambda: qemu_processes(str(rt.state)) == 0, 5, "QEMU to end with its runtime")
    if daemon_root:  # the private libvirtd went too
        assert not any(daemon_root.encode() in _cmdline(p) for p in os.listdir("/proc") if p.isdigit())

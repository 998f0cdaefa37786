"""The spare restore (the spec's ``standby``): made after each Ready, switched to by the next recycle,
ended when it does anything a waiting guest would not, and never made where two QEMUs of one
runtime would share what a lease reaches. Isolation across recycles with a spare is
tests/test_snapshots.py::test_recycle_restores_a_pristine_guest_with_nothing_of_the_last_lease[qemu-standby]."""

from __future__ import annotations

import asyncio
import os
import signal
from pathlib import Path
from typing import Any

import pytest
from test_metrics import key, scrape
from test_port_forwards import _read_forward, _serve_once
from test_snapshots import _readlink

from fixtures.health import health_runtime
from fixtures.ports import free_port
from fixtures.runtime import CLOCK_TICK, cpu_seconds, qemu_pids
from fixtures.waiting import wait_until_async
from vmsidecar_contract.spec import VmSpec
from vmsidecar_runtime.controller.standby import why_not
from vmsidecar_runtime.metrics import rss_bytes

pytestmark = pytest.mark.timeout(600)


async def test_a_spare_that_ends_on_its_own_gives_way_to_a_plain_restore_and_is_made_again(
        start_runtime: Any, tiny_image: Any) -> None:
    # a channel no other test's spec has: a snapshot key of its own; a forward on a fixed host port,
    # which the lease's QEMU holds while the spare runs, as a pool's provisioner sets (127.0.0.1:2222)
    fixed = free_port()
    spec = {"image": f"file:{tiny_image.disk}", "memory": "256M", "channels": [{"name": "standby"}],
            "network": {"forwards": [{"name": "web", "guest_port": 8080, "host_port": fixed}]}, "standby": True}
    rt, port = await health_runtime(start_runtime, spec)
    client = rt.client()
    await client.wait_ready(240)
    state = await client.wait_spare()
    assert state.snapshot.standby == "ready", state.snapshot
    spare_dir = rt.state / "spare"
    [spare] = qemu_pids(str(spare_dir))  # its own overlay, beside the lease's guest
    [live] = [pid for pid in qemu_pids(str(rt.state)) if pid != spare]
    # nothing reaches the next lease's guest before its lease: the spare listens on no port, the
    # lease's QEMU on the fixed one
    assert _listening_ports(spare) == set() and _listening_ports(live) == {fixed}
    # what the pool owner sees: a spare waits, and the pod's QEMU memory counts it
    samples = scrape(port)
    both = (rss_bytes(live) or 0) + (rss_bytes(spare) or 0)
    assert samples[key("vmsidecar_standby_ready")] == 1
    assert abs(samples[key("vmsidecar_qemu_resident_memory_bytes")] - both) < both / 10, (samples, both)

    os.kill(spare, signal.SIGKILL)
    state = await wait_until_async(lambda: _standby_is(client, "none"), 30, "the spare to be seen gone")
    assert "ended on its own (backend.exited)" in (state.snapshot.standby_reason or ""), state.snapshot
    assert (await client.state()).phase.value == "Ready"  # the lease's guest did not notice
    assert qemu_pids(str(rt.state)) == [live]
    assert scrape(port)[key("vmsidecar_standby_ready")] == 0

    await client.recycle()
    state = await client.wait_ready(120)
    assert state.snapshot.boot == "restored" and not state.snapshot.restored_ahead, state.snapshot
    assert state.snapshot.restore_seconds is not None and state.snapshot.restore_seconds > 0.01, state.snapshot

    state = await client.wait_spare()  # made again after that Ready
    assert state.snapshot.standby == "ready", state.snapshot
    [spare] = qemu_pids(str(spare_dir))
    await client.recycle()
    state = await client.wait_ready(120)
    assert state.snapshot.boot == "restored" and state.snapshot.restored_ahead, state.snapshot
    assert state.snapshot.clock == "no guest agent", state.snapshot  # the tiny guest runs none
    # the spare is the lease's guest now, its overlay moved where the lease's is (the next recycle discards it)
    assert str(rt.state / "overlay.qcow2") in _open_files(spare), _open_files(spare)
    # and the fixed port is its: the guest answers there
    assert state.forwards["web"] == f"127.0.0.1:{fixed}", state.forwards
    assert _listening_ports(spare) == {fixed}
    await _serve_once(rt, "from-the-adopted-spare")
    assert await _read_forward(state.forwards["web"]) == b"from-the-adopted-spare"

    await client.power("off", graceful=False)
    state = await client.put_spec({**spec, "memory": "288M"})
    assert state.snapshot.standby == "none", state.snapshot
    assert "the spec changed" in (state.snapshot.standby_reason or ""), state.snapshot
    await wait_until_async(lambda: not qemu_pids(str(rt.state)), 30, "every QEMU of the old spec to end")


async def test_a_parked_qemu_waits_with_nothing_loaded_and_the_recycle_loads_the_snapshot_into_it(
        start_runtime: Any, tiny_image: Any) -> None:
    """``standby: parked``: a paused QEMU with nothing loaded waits during the lease (no port, no
    CPU); the recycle restores into it; one that exits gives way to a plain restore and is made again.
    Isolation across recycles through it: test_snapshots.py::...[qemu-parked]."""
    fixed = free_port()
    spec = {"image": f"file:{tiny_image.disk}", "memory": "256M", "channels": [{"name": "parked"}],
            "network": {"forwards": [{"name": "web", "guest_port": 8080, "host_port": fixed}]}, "standby": "parked"}
    rt, port = await health_runtime(start_runtime, spec)
    client = rt.client()
    await client.wait_ready(240)
    state = await client.wait_spare()
    assert state.snapshot.standby == "parked" and state.snapshot.standby_reason is None, state.snapshot
    [parked] = qemu_pids(str(rt.state / "spare"))
    [live] = [pid for pid in qemu_pids(str(rt.state)) if pid != parked]
    assert _listening_ports(parked) == set() and _listening_ports(live) == {fixed}
    # nothing of a guest runs in it: its CPU time stands still (a running TCG guest's would not)
    before = cpu_seconds(parked)
    await asyncio.sleep(1.5)
    assert round((cpu_seconds(parked) - before) * CLOCK_TICK) <= 2, "the parked QEMU used CPU"  # (clock ticks)
    samples = scrape(port)
    assert samples[key("vmsidecar_standby_parked")] == 1 and samples[key("vmsidecar_standby_ready")] == 0

    await client.recycle()
    state = await client.wait_ready(120)
    assert state.snapshot.boot == "restored" and not state.snapshot.restored_ahead, state.snapshot
    assert state.snapshot.clock == "no guest agent", state.snapshot
    assert str(rt.state / "overlay.qcow2") in _open_files(parked), _open_files(parked)
    assert state.forwards["web"] == f"127.0.0.1:{fixed}" and _listening_ports(parked) == {fixed}, state.forwards
    await _serve_once(rt, "from-the-parked-qemu")
    assert await _read_forward(state.forwards["web"]) == b"from-the-parked-qemu"

    state = await client.wait_spare()  # parked again after that Ready
    assert state.snapshot.standby == "parked", state.snapshot
    [again] = [pid for pid in qemu_pids(str(rt.state / "spare")) if pid != parked]
    os.kill(again, signal.SIGKILL)
    state = await wait_until_async(lambda: _standby_is(client, "none"), 30, "the parked QEMU to be seen gone")
    assert "parked QEMU ended on its own (backend.exited)" in (state.snapshot.standby_reason or ""), state.snapshot
    assert scrape(port)[key("vmsidecar_standby_parked")] == 0
    await client.recycle()
    state = await client.wait_ready(120)
    assert state.snapshot.boot == "restored", state.snapshot
    assert parked not in qemu_pids(str(rt.state)) and again not in qemu_pids(str(rt.state))
    assert (await client.wait_spare()).snapshot.standby == "parked"  # and parked again after that Ready


def _listening_ports(pid: int) -> set[int]:
    """TCP ports process ``pid`` listens on (its sockets' inodes in /proc/net/tcp, state LISTEN)."""
    inodes = {link[len("socket:["):-1] for link in _open_files(pid) if link.startswith("socket:[")}
    ports = set()
    for table in ("tcp", "tcp6"):
        for line in Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A" and fields[9] in inodes:
                ports.add(int(fields[1].rsplit(":", 1)[1], 16))
    return ports


def _open_files(pid: int) -> list[str]:
    return [target for target in (_readlink(fd) for fd in Path(f"/proc/{pid}/fd").iterdir()) if target]


async def _standby_is(client: Any, status: str) -> Any:
    state = await client.state()
    return state if state.snapshot.standby == status else None


async def test_snapshot_off_makes_no_spare_even_where_the_cache_holds_the_specs_snapshot(
        start_runtime: Any, tiny_image: Any) -> None:
    """``snapshot: off`` means no restore; the snapshot's key leaves the field out (the same guest
    whether or not a spec looks for snapshots), so another runtime's capture of the same spec is in
    the shared cache: ``standby`` must not restore a spare from it all the same."""
    # the suite's common key: the shared cache mostly holds it already (then this restores)
    spec = {"image": f"file:{tiny_image.disk}", "memory": "256M"}
    capturing = await start_runtime(spec)
    await capturing.client().wait_ready(240)
    assert (await capturing.client().wait_stored(120)).snapshot.available
    capturing.stop()
    rt = await start_runtime({**spec, "snapshot": "off", "standby": True})
    client = rt.client()
    await client.wait_ready(240)
    state = await client.wait_spare()
    assert state.snapshot.standby == "none" and "snapshot: off" in (state.snapshot.standby_reason or ""), \
        state.snapshot
    assert state.snapshot.boot == "cold", state.snapshot
    assert len(qemu_pids(str(rt.state))) == 1 and not qemu_pids(str(rt.state / "spare"))


@pytest.mark.parametrize(("extra", "shared"), [
    ({"gpio": [{"name": "led", "direction": "out"}]}, "vhost-user GPIO device"),
    ({"can": [{"name": "can0", "mode": "native", "host_interface": "vcan0"}]}, "native CAN bus"),
    ({"backend": "libvirt"}, "libvirt backend"),
])
def test_no_spare_where_two_qemus_would_share_what_a_lease_reaches(extra: dict[str, Any], shared: str) -> None:
    assert shared in (why_not(VmSpec.model_validate({"image": "file:/d.qcow2", **extra})) or "")
    assert why_not(VmSpec.model_validate({"image": "file:/d.qcow2"})) is None

"""Backend-neutral events: each backend maps its own (QMP events, libvirt lifecycle callbacks) to
``BackendEvent``; ``create_backend`` and ``close_backends`` (pure, no hypervisor)."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from pathlib import Path

from qemu.qmp import EventListener
from qemu.qmp.message import Message

from vmsidecar_contract.spec import load_spec
from vmsidecar_runtime.backend import BackendEvent, close_backends, create_backend
from vmsidecar_runtime.backend.base import register_shared
from vmsidecar_runtime.backend.libvirt.backend import map_lifecycle
from vmsidecar_runtime.backend.qemu import QemuBackend, map_qmp_event
from vmsidecar_runtime.plan import BootPlan


def test_event_names_say_what_happened_not_which_backend() -> None:
    assert {e.value for e in BackendEvent} == {
        "guest.powered_off", "guest.reset", "guest.panicked", "guest.paused", "guest.resumed",
        "guest.powerdown_requested", "guest.io_error", "backend.exited",
    }


def test_qmp_events() -> None:
    assert map_qmp_event("SHUTDOWN", {"guest": True, "reason": "guest-shutdown"}) == (
        BackendEvent.POWERED_OFF, {"reason": "guest-shutdown", "guest": True})
    assert map_qmp_event("SHUTDOWN", {"guest": True, "reason": "guest-panic"}) == (
        BackendEvent.POWERED_OFF, {"reason": "guest-panic", "guest": True})
    # QMP quit and a host signal end QEMU despite -no-shutdown: the exit decides, not a power-off
    assert map_qmp_event("SHUTDOWN", {"guest": False, "reason": "host-qmp-quit"}) is None
    assert map_qmp_event("SHUTDOWN", {"guest": False, "reason": "host-signal"}) is None
    assert map_qmp_event("RESET", {"guest": False, "reason": "host-qmp-system-reset"}) == (
        BackendEvent.RESET, {"guest": False})
    assert map_qmp_event("RESET", {"guest": True, "reason": "guest-reset"}) == (BackendEvent.RESET, {"guest": True})
    assert map_qmp_event("POWERDOWN", {}) == (BackendEvent.POWERDOWN_REQUESTED, {})
    assert map_qmp_event("STOP", {}) == (BackendEvent.PAUSED, {})
    assert map_qmp_event("RESUME", {}) == (BackendEvent.RESUMED, {})
    assert map_qmp_event("GUEST_PANICKED", {"action": "pause"}) == (BackendEvent.PANICKED, {})
    assert map_qmp_event("BLOCK_IO_ERROR", {"device": "", "node-name": "disk0", "operation": "write", "action": "stop",
                                            "nospace": True, "reason": "No space left on device"}) == (
        BackendEvent.IO_ERROR, {"operation": "write", "action": "stop", "nospace": True,
                                "reason": "No space left on device"})
    assert map_qmp_event("BLOCK_JOB_COMPLETED", {}) is None


async def test_qmp_event_data_that_is_not_an_object_is_read_as_empty_and_the_pump_goes_on() -> None:
    """QMP's data is an object; a QEMU that sends anything else (the runtime's UID, if it escaped) must
    not end the pump that reports the guest's events: ``dict("x")`` raised and ended it."""
    events: list[tuple[BackendEvent, dict]] = []
    plan = BootPlan(load_spec({"image": "file:/x"}), "tcg", Path("/s/o.qcow2"), "qcow2", Path("/r"))
    backend = create_backend(plan, lambda event, data: events.append((event, data)))
    assert isinstance(backend, QemuBackend)
    listener = EventListener()
    pump = asyncio.create_task(backend._pump_events(listener))
    for data in ("x", 7, ["a"], None):
        await listener.put(Message({"event": "STOP", "data": data}))
    await listener.put(Message({"event": "RESUME", "data": {}}))
    for _ in range(100):
        if len(events) == 5 or pump.done():
            break
        await asyncio.sleep(0.01)
    assert not pump.done(), pump.exception()
    pump.cancel()
    assert events == [(BackendEvent.PAUSED, {})] * 4 + [(BackendEvent.RESUMED, {})]


def test_libvirt_lifecycle_events() -> None:
    suspended, resumed, stopped, shutdown, crashed = 3, 4, 5, 6, 8  # virDomainEventType
    assert map_lifecycle(suspended, 0) == (BackendEvent.PAUSED, {})
    assert map_lifecycle(resumed, 0) == (BackendEvent.RESUMED, {})
    for detail in (0, 1):  # FINISHED, GUEST
        assert map_lifecycle(shutdown, detail) == (BackendEvent.POWERED_OFF, {"reason": "guest-shutdown", "guest": True})
    assert map_lifecycle(shutdown, 2) is None  # HOST: QEMU got a signal (a destroy); STOPPED decides
    assert map_lifecycle(crashed, 0) == (BackendEvent.PANICKED, {})
    assert map_lifecycle(stopped, 1) == (BackendEvent.EXITED, {"reason": "domain stopped: destroyed"})
    assert map_lifecycle(stopped, 0) == (BackendEvent.EXITED, {"reason": "domain stopped: shutdown"})
    assert map_lifecycle(2, 0) is None  # STARTED: launch() itself says when the domain is up


def test_create_backend_picks_by_spec_and_loads_libvirt_only_when_asked() -> None:
    plan = BootPlan(load_spec({"image": "file:/x"}), "tcg", Path("/s/o.qcow2"), "qcow2", Path("/r"))
    backend = create_backend(plan, lambda event, data: None)
    assert isinstance(backend, QemuBackend) and (backend.name, backend.label) == ("qemu", "QEMU")
    # in a fresh interpreter: a qemu backend never imports the libvirt modules (an optional extra)
    code = ("import sys\nfrom pathlib import Path\nfrom vmsidecar_runtime.backend import create_backend\n"
            "from vmsidecar_runtime.plan import BootPlan\nfrom vmsidecar_contract.spec import load_spec\n"
            "create_backend(BootPlan(load_spec({}), 'tcg', Path('/o'), 'qcow2', Path('/r')), lambda e, d: None)\n"
            "print(sorted(m for m in sys.modules if 'libvirt' in m))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


async def test_close_backends_is_a_noop_without_shared_resources_and_closes_each_once() -> None:
    await close_backends()  # nothing registered: nothing happens
    closed: list[str] = []

    async def close_a() -> None:
        closed.append("a")

    async def close_b() -> None:
        closed.append("b")
        raise RuntimeError("already gone")  # logged; the runtime must still finish its exit

    register_shared("a", close_a)
    register_shared("b", close_b)
    register_shared("a", close_a)  # once per name
    await close_backends()
    await close_backends()
    assert sorted(closed) == ["a", "b"]



async def test_a_flood_of_qmp_events_holds_no_memory_in_the_runtime(tmp_path: Path) -> None:
    """Root in the guest can make QEMU emit events without end (a loop writing the ACPI CPU hotplug
    _OST status: ACPI_DEVICE_OST is not among the events QEMU throttles; reboot loops: RESET).
    qemu.qmp's client keeps every event in its default listener's history and queue, which nothing
    here reads, and the runtime's own listener kept a history of those it takes: ~1.9 KB an event,
    for as long as the QEMU runs (101,000 events: 186 MiB). QEMU's side is played by a socket that
    speaks QMP (a guest that floods it cannot be booted here)."""
    import gc
    import json

    ost = json.dumps({"event": "ACPI_DEVICE_OST", "timestamp": {"seconds": 1, "microseconds": 2},
                      "data": {"info": {"device": "", "slot": "0", "slot-type": "CPU", "source": 0,
                                        "status": 0}}}).encode() + b"\r\n"
    reset = json.dumps({"event": "RESET", "timestamp": {"seconds": 1, "microseconds": 2},
                        "data": {"guest": True, "reason": "guest-reset"}}).encode() + b"\r\n"
    sent = asyncio.Event()

    async def qemu(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(json.dumps({"QMP": {"version": {"qemu": {"micro": 0, "minor": 2, "major": 7},
                                                     "package": ""}, "capabilities": []}}).encode() + b"\r\n")
        received = b""
        while True:  # qmp_capabilities (qemu.qmp ends a message with no newline)
            received += await reader.read(4096)
            try:
                command = json.loads(received)
                break
            except ValueError:
                continue
        writer.write(json.dumps({"return": {}, "id": command.get("id")}).encode() + b"\r\n")
        await asyncio.sleep(0.5)  # (events before the backend listens are dropped, by QEMU's as well)
        for _ in range(30):
            writer.write(ost * 1000 + reset * 20)
            await writer.drain()
        sent.set()
        await asyncio.sleep(60)

    plan = BootPlan(load_spec({"image": "file:/x"}), "tcg", tmp_path / "o.qcow2", "qcow2", tmp_path)
    server = await asyncio.start_unix_server(qemu, path=str(plan.qmp_socket))
    events: list[BackendEvent] = []
    backend = QemuBackend(plan, lambda event, data: events.append(event))
    before = _rss()
    try:
        await backend._connect_qmp(10)
        await asyncio.wait_for(sent.wait(), 60)
        for _ in range(1200):  # (the events are parsed as they come: seconds, more on a busy machine)
            if len(events) >= 600:
                break
            await asyncio.sleep(0.05)
        gc.collect()
        held = _rss() - before
    finally:
        server.close()
        if backend._qmp is not None:
            await backend._qmp.disconnect()
        for task in backend._tasks:
            task.cancel()
    assert events.count(BackendEvent.RESET) == 600, f"{len(events)} events reported: {set(events)}"
    assert held < 16 << 20, f"the runtime holds {held >> 20} MiB more after 30,600 QMP events"


def _rss() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) << 10
    raise AssertionError("no VmRSS")

"""Each backend on its own, without the controller: a real guest (TCG) and the neutral events it
reports for power-on, reset, the ACPI button, a guest power-off, a quit and a kill."""

from __future__ import annotations

import asyncio
import os
import shutil
import socket
import subprocess
import tempfile
import threading
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from fixtures.runtime import BACKENDS, _libvirt_problem, qemu_pids
from vmsidecar_contract.spec import load_spec
from vmsidecar_images.console import Console
from vmsidecar_runtime.backend import Backend, BackendEvent, close_backends, create_backend
from vmsidecar_runtime.plan import SERIAL, BootPlan

pytestmark = pytest.mark.timeout(300)


class Recorder:
    """The controller's side of ``EventSink``: every event in order, and a way to wait for one."""

    def __init__(self) -> None:
        self.events: list[tuple[BackendEvent, dict[str, Any]]] = []
        self.threads: set[int] = set()
        self._changed = asyncio.Event()

    def __call__(self, event: BackendEvent, data: dict[str, Any]) -> None:
        self.threads.add(threading.get_ident())
        self.events.append((event, data))
        self._changed.set()

    async def wait_for(self, event: BackendEvent, timeout: float = 60, **data: Any) -> dict[str, Any]:
        """The first ``event`` recorded whose data contains ``data``."""
        async with asyncio.timeout(timeout):
            while True:
                for seen, seen_data in self.events:
                    if seen == event and data.items() <= seen_data.items():
                        return seen_data
                self._changed.clear()
                await self._changed.wait()

    def kinds(self) -> list[BackendEvent]:
        return [event for event, _ in self.events]


@pytest.fixture
async def boot(tiny_image: Any) -> AsyncIterator[Any]:
    """``boot(backend)``: a launched (paused) backend for the tiny guest on a fresh overlay."""
    run_dir = Path(tempfile.mkdtemp(prefix="vmsidecar-"))  # short: Unix socket paths are limited
    made: list[Backend] = []

    async def make(backend: str) -> tuple[Backend, BootPlan, Recorder]:
        overlay = run_dir / "overlay.qcow2"
        subprocess.run(["qemu-img", "create", "-q", "-f", "qcow2", "-F", "qcow2", "-b", str(tiny_image.disk),
                        str(overlay)], check=True)
        spec = load_spec({"image": f"file:{tiny_image.disk}", "memory": "256M", "backend": backend})
        plan = BootPlan(spec, "tcg", overlay, "qcow2", run_dir, disk_chain=(tiny_image.disk,))
        recorder = Recorder()
        made.append(created := create_backend(plan, recorder))
        await created.launch()
        return created, plan, recorder

    yield make
    for backend in made:
        if backend.alive:
            await backend.kill()
    await close_backends()  # the private libvirtd of a libvirt boot
    shutil.rmtree(run_dir, ignore_errors=True)


async def _serial(vm: Backend) -> Console:
    """The guest's serial console as the runtime takes it: QEMU's socket, which the QEMU backend
    holds a connection to from its launch (a connect of our own would wait behind it)."""
    upstream = vm.upstream(SERIAL)
    if isinstance(upstream, socket.socket):
        return Console(*await asyncio.open_unix_connection(sock=upstream))
    assert isinstance(upstream, Path)
    return await Console.open(upstream)


@pytest.mark.parametrize("backend", BACKENDS)
async def test_reset_acpi_power_off_and_quit(boot: Any, backend: str) -> None:
    vm, _plan, recorder = await boot(backend)
    assert vm.name == backend and vm.label == {"qemu": "QEMU", "libvirt": "the libvirt domain"}[backend]
    assert vm.alive and vm.exit_info is None
    console = await _serial(vm)  # paused: attach before the first byte
    await vm.resume()
    await recorder.wait_for(BackendEvent.RESUMED)
    await console.expect("VMSIDECAR-READY", 180)

    await vm.reset()  # ours: guest False (SeaBIOS may add resets of its own, guest True)
    await recorder.wait_for(BackendEvent.RESET, guest=False)
    console.seen.clear()
    await console.expect("VMSIDECAR-READY", 180)

    await vm.powerdown()  # the ACPI button: the tiny guest powers itself off
    await recorder.wait_for(BackendEvent.POWERDOWN_REQUESTED)
    assert await recorder.wait_for(BackendEvent.POWERED_OFF) == {"reason": "guest-shutdown", "guest": True}
    await console.close()
    if backend == "qemu":
        assert vm.alive  # -no-shutdown: QEMU waits for the runtime
    await vm.quit()
    assert not vm.alive and vm.exit_info is not None
    exited = await recorder.wait_for(BackendEvent.EXITED)
    if backend == "qemu":
        # QEMU's SHUTDOWN cause for our QMP quit travels with the exit
        assert exited == {"returncode": 0, "reason": "host-qmp-quit"} and vm.exit_info.returncode == 0
    else:  # on_poweroff destroy ends the domain by itself ("shutdown"), unless our quit was first ("destroyed")
        assert exited["reason"] in ("domain stopped: shutdown", "domain stopped: destroyed"), exited
        assert vm.exit_info.reason == exited["reason"]
    # one power-off, one exit: quitting QEMU (QMP quit) is no second power-off
    assert recorder.kinds().count(BackendEvent.POWERED_OFF) == 1
    assert recorder.kinds().count(BackendEvent.EXITED) == 1
    assert recorder.threads == {threading.get_ident()}  # always on the loop, never libvirt's event thread


@pytest.mark.parametrize("backend", BACKENDS)
async def test_kill_is_an_exit_and_no_power_off(boot: Any, backend: str) -> None:
    vm, _plan, recorder = await boot(backend)
    await vm.kill()
    assert not vm.alive
    exited = await recorder.wait_for(BackendEvent.EXITED)
    if backend == "qemu":
        assert exited == {"signal": 9} and vm.exit_info is not None and vm.exit_info.signal == 9
    else:
        assert exited == {"reason": "domain stopped: destroyed"}
    assert BackendEvent.POWERED_OFF not in recorder.kinds()


@pytest.mark.skipif(_libvirt_problem() is not None, reason=str(_libvirt_problem()))
async def test_close_backends_stops_the_private_libvirtd(boot: Any) -> None:
    vm, plan, _recorder = await boot("libvirt")
    root = str(plan.run_dir / "libvirt")

    def daemon_processes() -> list[str]:
        found = []
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                if root.encode() in Path(f"/proc/{pid}/cmdline").read_bytes():
                    found.append(pid)
            except OSError:
                continue
        return found

    assert daemon_processes()
    await vm.quit()
    await close_backends()
    assert daemon_processes() == []
    await close_backends()  # nothing left: a no-op


async def test_a_quit_that_leaves_the_reaping_to_a_task_returns_with_nothing_held_and_reports_nothing(
    boot: Any,
) -> None:
    """``quit(reaped=False)``, a recycle's: it returns once QEMU is in its exit, which the runtime
    reaps in a task while the kernel frees QEMU's memory; QEMU's disk is no longer locked then, and
    nothing of that process is reported afterwards; ``close_backends`` waits for the reaping, of the
    process and of its pipes (a pipe still open when the loop closes is a transport collected on a
    closed loop: "Event loop is closed", seen in the suite)."""
    vm, plan, recorder = await boot("qemu")
    console = await _serial(vm)
    await vm.resume()
    await console.expect("VMSIDECAR-READY", 180)
    await console.close()
    (pid,) = qemu_pids(str(plan.run_dir))
    await vm.quit(reaped=False)
    assert qemu_pids(str(plan.run_dir)) == []  # in its exit (PF_EXITING) or gone: it runs nothing
    # qemu-img refuses an image a running QEMU holds open for writing ("Failed to get shared 'write' lock")
    subprocess.run(["qemu-img", "info", "-f", "qcow2", str(plan.disk)], check=True, capture_output=True)
    await close_backends()
    assert not Path(f"/proc/{pid}").exists()  # reaped: no zombie
    # and its pipes read to their end by their readers, not left to the loop by cancelling them
    assert vm._proc.stdout.at_eof() and vm._proc.stderr.at_eof()
    assert vm._readers and all(r.done() and not r.cancelled() for r in vm._readers)
    await asyncio.sleep(0.2)
    assert BackendEvent.EXITED not in recorder.kinds()

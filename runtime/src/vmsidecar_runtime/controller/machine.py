"""The hypervisor side of the guest: one backend per boot, and what belongs to one boot.

``Machine`` builds a boot's plan, launches the backend paused, attaches the guest streams and lets
the guest run; it resets, presses the ACPI power button, stops and kills. It counts boots and keeps
each boot's timings. It never changes the phase: the backend's events go to the ``on_event`` it
was given (the controller's state machine), and its methods return what happened.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from vmsidecar_contract.errors import GuestError, HostError, VmsidecarError
from vmsidecar_contract.spec import VmSpec
from vmsidecar_contract.state import ExitInfo, Timings

from .. import ports
from ..accel import AccelChoice, choose_accel
from ..backend import Backend, BackendEvent, BackendFactory, EventSink
from ..events import EventBus
from ..firmware import prepare_firmware
from ..plan import BootPlan, RamFile
from .lease import LeaseEnded, unless_ended
from .paths import RuntimePaths
from .streams import GuestStreams

log = logging.getLogger(__name__)

#: RESET events this soon after a boot started belong to that boot (see ``is_new_boot``)
RESET_COALESCE_S = 1.0
#: launches tried when a forward's host port is taken between its choice and QEMU's bind
PORT_ATTEMPTS = 3


def disk_io_error(data: dict[str, Any], paths: RuntimePaths) -> HostError:
    """What a guest paused by a host I/O error on its disk (``guest.io_error``, action stop) is told."""
    why = data.get("reason") or "I/O error"
    if data.get("nospace"):
        return HostError(
            f"the state volume is full: the guest's disk overlay {paths.overlay} cannot grow ({why}), so the guest "
            f"is paused; recycle to drop this lease's disk changes (a power cycle keeps them), and give the state "
            f"directory {paths.state} a larger volume (the emptyDir's sizeLimit, --state-dir) if the guest needs more")
    return HostError(f"the guest's disk could not be {'read' if data.get('operation') == 'read' else 'written'} on "
                     f"the host ({why}), so the guest is paused; check the volume of {paths.state} and recycle")


class Machine:
    """The backend of the current boot (at most one), the boot counter and this boot's timings."""

    def __init__(self, paths: RuntimePaths, streams: GuestStreams, events: EventBus,
                 backend_factory: BackendFactory, on_event: EventSink) -> None:
        self._paths = paths
        self._streams = streams
        self._events = events
        self._factory = backend_factory
        self._on_event = on_event
        self.backend: Backend | None = None
        self.plan: BootPlan | None = None
        self.accel: AccelChoice | None = None
        #: the backend is being ended on purpose: its power-off or exit is no crash
        self.expect_exit = False
        self.last_exit: ExitInfo | None = None
        self.timings = Timings()
        #: boots of this lease's generation (power-on, reset, guest reboot): scrollback, first-byte
        #: time and readiness belong to one boot, so a reader can never take the last boot for this
        #: one; counted per generation, or the next lease would read how often the last one booted
        self.boot_count = 0
        self._boot_started = 0.0
        self._boot_runs_firmware = True

    @property
    def event_sink(self) -> EventSink:
        """Where this boot's backend reports (a spare's, once adopted, too)."""
        return self._on_event

    @property
    def alive(self) -> bool:
        """Whether a backend process/domain exists and runs."""
        return self.backend is not None and self.backend.alive

    def forwards(self) -> dict[str, str]:
        """Each network forward's host address while a backend holds its port: once that is gone
        (stopped, crashed, a recycle without a boot) the port may be any process's of the pod."""
        plan = self.plan
        if plan is None or not self.alive:
            return {}
        return {f.name: f"{f.host_address}:{plan.ports[f.name]}" for f in plan.spec.network.forwards
                if f.name in plan.ports}

    def choose_accel(self, spec: VmSpec) -> AccelChoice:
        """KVM or TCG for the next boot, with the reason."""
        self.accel = choose_accel(spec.accel, spec.arch)
        return self.accel

    # ---- per boot ------------------------------------------------------------------------
    def begin_boot(self, reason: str, *, firmware: bool = True) -> None:
        """A new boot starts: its own scrollback, first-byte time and readiness timings.
        ``firmware`` is false for a restore: the guest goes on where its capture stopped."""
        self.boot_count += 1
        self._boot_started = time.monotonic()
        self._boot_runs_firmware = firmware
        self.timings = Timings(launched_at=time.time(), pull=self.timings.pull)
        self._streams.new_boot()
        self._events.publish("boot", boot=self.boot_count, reason=reason)

    def is_new_boot(self) -> bool:
        """Whether a RESET event starts a boot. Our own system_reset, and the one or two resets
        SeaBIOS adds within ~50 ms of it, belong to the boot already begun; so does a reset before
        the boot printed anything. No guest reboots within a second of its firmware starting. A
        restored guest runs no firmware and may reboot at once (its shell answered in 0.2 s)."""
        if not self._boot_runs_firmware:
            return True
        return self._streams.boot_has_output() and time.monotonic() - self._boot_started > RESET_COALESCE_S

    def ready(self) -> Timings:
        """This boot is Ready: its timings, now complete."""
        first = self._streams.first_byte_at()
        self.timings = self.timings.model_copy(update={
            "ready": round(time.monotonic() - self._boot_started, 3),
            "first_console_byte": round(first - self._boot_started, 3) if first else None,
        })
        return self.timings

    def record_pull(self, seconds: float) -> None:
        self.timings = self.timings.model_copy(update={"pull": seconds})

    def forget_lease(self) -> None:
        """A new lease: no timing, exit or boot count of the previous one shows."""
        self.timings = Timings()
        self.last_exit = None
        self.boot_count = 0

    # ---- the backend ---------------------------------------------------------------------
    async def launch(self, spec: VmSpec, overlay: Path, chain: tuple[Path, ...], incoming: Path | None = None,
                     ram: RamFile | None = None, incoming_check: asyncio.Future[str | None] | None = None) -> None:
        """Start the backend paused on ``overlay`` (standing on ``chain``), attach every stream,
        then let the guest run.

        :raise HostError: the backend cannot start.
        """
        plan, backend = await self._launch_paused(
            lambda: self.new_plan(spec, overlay, chain, self._paths.run, self._paths.state, incoming, ram,
                                  incoming_check),
            self._on_event, current=True)
        await self._streams.attach(plan, backend)
        await backend.resume()

    async def launch_spare(self, make_plan: Callable[[], BootPlan], on_event: EventSink, *,
                           load: bool = True) -> tuple[BootPlan, Backend]:
        """Start a backend paused that is not this boot's (a spare restore, or with ``load`` False a
        parked QEMU: ``standby.py``): no stream is attached; ``adopt`` makes it the boot's.

        :raise HostError: the backend cannot start (nothing of it is left running).
        """
        return await self._launch_paused(make_plan, on_event, current=False, load=load)

    async def _launch_paused(self, make_plan: Callable[[], BootPlan], on_event: EventSink, *,
                             current: bool, load: bool = True) -> tuple[BootPlan, Backend]:
        """A free host port for a forward is only free until QEMU binds it: another process may take
        it in between. QEMU then refuses the forwarding rule and exits; the launch is retried on
        new ports. ``current``: the backend is this boot's from the start (a failed one is left
        for the caller's ``stop``)."""
        for attempt in range(1, PORT_ATTEMPTS + 1):
            plan = make_plan()
            backend = self._factory(plan, on_event)
            if current:
                self.plan, self.backend, self.expect_exit, self.last_exit = plan, backend, False, None
                await self._streams.before_launch(plan)
            try:
                await backend.launch(load=load)
                return plan, backend
            except HostError as e:
                retry = "host forwarding rule" in e.message and attempt < PORT_ATTEMPTS
                if current and retry:
                    await self.stop()
                elif not current:
                    await backend.quit(timeout=1)
                if not retry:
                    if "host forwarding rule" in e.message:  # a fixed port, taken since it was checked
                        raise ports.PortTaken(e.message) from e
                    raise
                log.warning("a forward's host port was taken before QEMU bound it; retrying on new ports")
            except BaseException:  # cancelled: a spare nobody holds must not run on
                if not current:
                    await backend.quit(timeout=1)
                raise
        raise AssertionError("unreachable: the last attempt returns or raises")

    async def adopt(self, plan: BootPlan, backend: Backend) -> None:
        """Make a running spare backend (``launch_spare``) this boot's: its forwards are bound now
        (a fixed host port was the last boot's until it stopped; a spare has no port anyone could
        reach), and its streams attached (what it wrote on its virtio consoles meanwhile waits in
        their pipes).

        :raise HostError: a forward's port cannot be bound; :raise TimeoutError: a backend socket
            does not accept (the caller stops it either way).
        """
        self.plan, self.backend, self.expect_exit, self.last_exit = plan, backend, False, None
        bound: dict[str, int] = {}
        for forward in plan.spec.network.forwards:
            for attempt in range(1, PORT_ATTEMPTS + 1):
                port = ports.allocate([forward])[forward.name]
                try:
                    await backend.add_forward(forward, port)
                    break
                except HostError:  # a free port taken since it was chosen: another (a fixed one is taken)
                    if forward.host_port or attempt == PORT_ATTEMPTS:
                        raise
            bound[forward.name] = port
        self.plan = dataclasses.replace(plan, ports=bound)
        await self._streams.attach(plan, backend)

    def new_plan(self, spec: VmSpec, overlay: Path, chain: tuple[Path, ...], run_dir: Path, state_dir: Path,
                 incoming: Path | None = None, ram: RamFile | None = None,
                 incoming_check: asyncio.Future[str | None] | None = None, *, spare: bool = False) -> BootPlan:
        """A boot's plan: on ``overlay`` standing on ``chain``, its sockets in ``run_dir``, its UEFI
        vars (if any) in ``state_dir``. A ``spare`` binds no forward: ``adopt`` binds them."""
        assert self.accel is not None
        return BootPlan(spec=spec, accel=self.accel.accel, disk=overlay, disk_format="qcow2",
                        run_dir=run_dir, ports={} if spare else ports.allocate(spec.network.forwards),
                        firmware=prepare_firmware(spec, state_dir), incoming=incoming, ram=ram,
                        incoming_check=incoming_check, disk_chain=chain)

    async def reset(self) -> None:
        """Hard reset, like the reset button."""
        assert self.backend is not None
        await self.backend.reset()

    async def powerdown(self, timeout: float, *, until: asyncio.Event | None = None) -> bool:
        """Press the ACPI power button and wait for the guest to power off; False on timeout, or
        once ``until`` is set (the lease that asked ended: the guest is forced off, at once)."""
        backend = self.backend
        assert backend is not None
        self.expect_exit = True
        async with self._events.listen({BackendEvent.POWERED_OFF, BackendEvent.EXITED}) as queue:
            try:
                await backend.powerdown()
                await unless_ended(queue.get(), until, timeout)
                return True
            except LeaseEnded:
                log.warning("the lease that asked for the power-down ended; forcing the guest off")
                return False
            except TimeoutError:  # before OSError, of which it is a subclass
                log.warning("guest ignored ACPI power-down for %.0f s; forcing it off", timeout)
                self._events.publish("powerdown_timeout", timeout=timeout)
                return False
            except (VmsidecarError, OSError, EOFError):
                return False

    async def stop(self) -> None:
        """End the backend process, bounded; the streams stop draining (their clients stay)."""
        backend = self.backend
        if backend is None:
            return
        self.expect_exit = True
        # a next boot does not wait for the kernel to free the last one's memory (``QemuBackend.quit``)
        await backend.quit(timeout=5 if backend.alive else 1, reaped=False)
        self.last_exit = backend.exit_info
        # alive after quit: in its exit, reaped beside what comes next
        await self._streams.detach(exiting=backend.alive)
        self.backend = None

    async def kill(self) -> None:
        """SIGKILL the backend, whatever it was doing."""
        backend = self.backend
        if backend is not None and backend.alive:
            await backend.kill()

    async def crashed(self) -> GuestError:
        """The backend exited without being asked to: record how, drop it, and say what happened."""
        backend = self.backend
        assert backend is not None
        info = backend.exit_info or ExitInfo()
        why = info.reason  # libvirt knows no exit status, only why the domain stopped
        info.reason = f"{backend.label} exited without being asked to"
        self.last_exit = info
        await self._streams.detach()
        self.backend = None
        how = (f"signal {info.signal}" if info.signal else f"exit code {info.returncode}"
               if info.returncode is not None or not why else why)
        tail = " | ".join(info.stderr_tail[-3:]) or "no output"
        return GuestError(f"{backend.label} died unexpectedly ({how}; stderr: {tail}); power on again to recover")

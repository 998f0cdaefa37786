"""The guest's power: boot, stop, reset, and what the backend and the readiness watch report.

``Power`` moves the phase through a boot (Pulling, Starting, Running, Ready; Stopping, Stopped;
Error, Crashed). Callers hold the power lock (``PhaseMachine.lock``) and have checked the phase at
the door; what happens on its own (the guest powers off, reboots, crashes, becomes Ready, a
capture at Ready) takes the lock here. How the guest boots is ``Boot``'s; the backend process is
``Machine``'s.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from vmsidecar_contract.canhost import check_native_can
from vmsidecar_contract.errors import TransferError, VmsidecarError
from vmsidecar_contract.spec import VmSpec
from vmsidecar_contract.state import LIVE, Phase

from .. import metrics
from ..audit import redact
from ..backend import Backend, BackendEvent, BackendFactory
from ..disk import DiskImage
from ..events import EventBus
from .boot import Boot
from .disks import Disks, Progress
from .lease import Lease, LeaseEnded, unless_ended
from .machine import Machine, disk_io_error
from .paths import RuntimePaths
from .phase import PhaseMachine, require_spec, unexpected
from .readiness import ReadinessWatch
from .settle import settle_limit, until_settled
from .snapshot_ops import SnapshotOps
from .standby import Standby
from .streams import GuestStreams
from .transfers import Transfer, Transfers

log = logging.getLogger(__name__)


def _unexpected(e: Exception, what: str) -> VmsidecarError:
    """The error of a boot or a capture for an exception nobody raised on purpose (a bug)."""
    return VmsidecarError(f"{unexpected(e, what)}; power on again to retry", code="internal_error")


@dataclass(frozen=True)
class _UntilReady:
    """A boot under way, timed to its Ready (``boot_to_ready_seconds``, ``recycle_to_ready_seconds``)."""

    kind: metrics.BootKind
    started: float
    recycle_started: float | None


class Power:
    """Boots and stops the guest, and follows it between operations."""

    def __init__(self, paths: RuntimePaths, phases: PhaseMachine, events: EventBus, disks: Disks,
                 streams: GuestStreams, snapshots: SnapshotOps, lease: Lease, transfers: Transfers,
                 backend_factory: BackendFactory) -> None:
        self._paths = paths
        self._phases = phases
        self._events = events
        self._disks = disks
        self._streams = streams
        self._snapshots = snapshots
        self._lease = lease
        self._transfers = transfers
        self.machine = Machine(paths, streams, events, backend_factory, self._on_backend_event)
        #: a spare restore for the next recycle (the spec's ``standby``)
        self.standby = Standby(paths, self.machine, snapshots)
        self._boot = Boot(disks, streams, self.machine, snapshots, self.standby, running=self._running,
                          spawn=self._spawn)
        self._readiness = ReadinessWatch(self._mark_ready, self._not_ready)
        #: the spec of the current boot (readiness is re-armed with it when the guest reboots)
        self._spec: VmSpec | None = None
        #: the boot whose Ready is to be timed (None after a reset, a stop or a failure)
        self._until_ready: _UntilReady | None = None
        self._background: set[asyncio.Task[None]] = set()

    def _spawn(self, coro: Any) -> None:
        task = asyncio.create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def pull(self, spec: VmSpec, reference: str | None = None, *, progress: Progress | None = None,
                   transfer: Transfer | None = None, on_download: Callable[[str], None] | None = None) -> DiskImage:
        """Pull an image (``Transfers.pull``; no lock needed, nothing is installed), its time kept
        in the timings."""
        disk, seconds = await self._transfers.pull(spec, reference, progress=progress, transfer=transfer,
                                                   on_download=on_download)
        self.machine.record_pull(seconds)
        return disk

    # ---- under the caller's lock ---------------------------------------------------------
    async def ensure_disk(self, spec: VmSpec | None) -> DiskImage:
        """The disk to boot, pulling the spec's image first (phase Pulling) when none is there.

        :raise VmsidecarError: the pull failed, or there is no spec to pull (phase Error).
        """
        if self._disks.current is None:
            previous = self._phases.phase
            self._phases.set(Phase.PULLING)
            loop = asyncio.get_running_loop()
            try:
                required = require_spec(spec)

                def downloading(manifest: str) -> None:  # the pull's thread: the image is not cached
                    # its snapshot (snapshot_source) is fetched meanwhile, not after the disk
                    loop.call_soon_threadsafe(self._snapshots.source.start, required, manifest)

                # a lease's pull (its power-on, its dump) holds the lock: the lease's end cuts it, or
                # the recycle and the next claim wait for it (the image may be the lease's own, from a
                # registry that trickles, up to the pull deadline); a pod's first pull is no lease's
                until = self._lease.ending if self._lease.claimed else None
                try:
                    self._disks.base = await unless_ended(self.pull(required, on_download=downloading), until)
                except LeaseEnded:
                    raise TransferError(f"the pull of {redact(required.image or '')} was cut: the lease that "
                                        "started it ended; nothing was installed", code="transfer_cancelled") from None
            except VmsidecarError as e:
                self._snapshots.source.drop()
                self._phases.fail(Phase.ERROR, e)
                raise
            self._phases.set(previous if previous != Phase.PULLING else Phase.STOPPED)
        assert self._disks.current is not None
        return self._disks.current

    async def clock_settled(self) -> None:
        """Return once a restored guest's clock is set, if one is being set (``Boot.clock_settled``)."""
        await self._boot.clock_settled()

    async def boot(self, spec: VmSpec, *, recycle_started: float | None = None) -> None:
        """Boot a fresh overlay of the disk (pulled first when needed): restored, or cold and watched.
        ``recycle_started``: this boot ends a recycle begun then (timed to Ready).

        :raise VmsidecarError: the boot failed (phase Error, the backend stopped).
        """
        await self.stop(graceful=False)  # a leftover from Error/Crashed
        try:
            check_native_can(spec)
            await self.ensure_disk(spec)
            self._spec = spec
            self._phases.set(Phase.STARTING)
            started = time.monotonic()
            restored = await self._boot.start(spec, until=self._lease.ending if self._lease.claimed else None)
            kind: metrics.BootKind = "cold" if not restored else (
                "registry_warm" if self._snapshots.info.boot == "registry_warm" else "restored")
            metrics.boots.labels(kind).inc()
            self._until_ready = _UntilReady(kind, started, recycle_started)
            if restored:
                if self._lease.claimed:  # a lease has this boot (its power-on, its claim during the pull):
                    await self._boot.clock_settled()  # Ready, for it, means the clock is set
                self._set_ready()
            else:
                self._readiness.arm(spec, self._streams.hubs, self._disks.current)
        except Exception as e:
            error = await self._failed(e, "boot")
            if error is e:
                raise
            raise error from e

    async def _failed(self, e: Exception, what: str) -> VmsidecarError:
        """A boot or a capture (``what``) failed: the backend is stopped and the phase is Error, with
        ``e`` or, for a bug's exception, ``internal_error`` naming it (never the phase it raised in)."""
        error = e if isinstance(e, VmsidecarError) else _unexpected(e, what)
        self._until_ready = None
        await self.stop(graceful=False)
        self._phases.fail(Phase.ERROR, error)
        return error

    async def stop(self, *, graceful: bool, timeout: float = 60.0) -> None:
        """End the backend, if any: ACPI first when ``graceful`` and the guest is Ready (bounded by
        ``timeout``). The phase stays Stopping; the caller says what comes next."""
        if self.machine.backend is None:
            return
        self._until_ready = None
        self._readiness.disarm()
        if self.machine.alive:
            # A guest still booting has nothing to save and usually no ACPI handler yet: stop it hard.
            graceful = graceful and self._phases.phase == Phase.READY
            self._phases.set(Phase.STOPPING, graceful=graceful)
            if graceful:  # (a lease's: cut short when that lease ends)
                await self.machine.powerdown(timeout, until=self._lease.ending)
        await self.machine.stop()
        self._free_live_ram()

    async def off(self, *, graceful: bool, timeout: float) -> None:
        """Power off a guest that runs (or failed while running), and be Stopped."""
        if self._phases.phase in LIVE or self._phases.phase == Phase.ERROR:
            await self.stop(graceful=graceful, timeout=timeout)
        self._phases.set(Phase.STOPPED)

    async def reset(self) -> None:
        """Hard reset of a live guest: a new boot on the same disk, watched for readiness."""
        assert self._spec is not None
        self._readiness.disarm()
        self._until_ready = None  # a reset's boot is no boot from off (not timed)
        self.machine.begin_boot("reset")
        await self.machine.reset()
        self._phases.set(Phase.RUNNING, reason="reset")
        self._readiness.arm(self._spec, self._streams.hubs, self._disks.current)

    # ---- on its own ----------------------------------------------------------------------
    def _running(self) -> None:
        accel = self.machine.accel
        assert accel is not None
        self._phases.set(Phase.RUNNING, accel=accel.accel, accel_reason=accel.reason)

    def _mark_ready(self) -> None:
        """The readiness watch saw the pattern: Ready; a boot that captures a snapshot is captured
        once it settled (never once a lease has the guest: its activity must not reach the snapshot)."""
        key = self._snapshots.take_capture()
        if key is not None and not self._lease.claimed:
            self._spawn(self._capture(key))
            return
        if key is not None:
            self._snapshots.abandon_capture()
        self._set_ready()

    def _not_ready(self, error: VmsidecarError) -> None:
        self._snapshots.not_ready()
        self._phases.fail(Phase.ERROR, error)

    def _set_ready(self, *, refill: bool = True) -> None:
        if self._phases.phase != Phase.READY:  # Ready before its capture: its timings end at the marker
            self._phases.set(Phase.READY, timings=self.machine.ready().model_dump())
        if refill and self._spec is not None:
            self.standby.refill(self._spec, after=self._boot.clock_settled)
        timed, self._until_ready = self._until_ready, None
        if timed is not None:
            now = time.monotonic()
            metrics.boot_to_ready.labels(timed.kind).observe(now - timed.started)
            if timed.recycle_started is not None:
                metrics.recycle_to_ready.observe(now - timed.recycle_started)

    async def _capture(self, key: str) -> None:
        async with self._phases.lock:
            backend = self.machine.backend
            if backend is None or self._phases.phase != Phase.RUNNING or self._spec is None:
                return  # powered off or failed while waiting for the lock
            if self._lease.claimed:
                self._snapshots.abandon_capture()
                self._set_ready()
                return
            with self._snapshots.capturing():
                if not await self._settle(backend):
                    return
                try:
                    went_on = await self._boot.capture(self._spec, key, backend)
                except Exception as e:  # the guest went on nowhere (no room for its overlay), or a bug
                    await self._failed(e, "capture")  # left it where nobody knows (paused?)
                    return
                if went_on:
                    self._set_ready()
                else:
                    self._readiness.arm(self._spec, self._streams.hubs, self._disks.current)

    async def _settle(self, backend: Backend) -> bool:
        """Return once the guest settled (``settle.py``), or something wants it, with the power lock
        held all along; Ready as the wait begins, if there is one (False: the guest went away
        meanwhile, nothing is captured). Console input typed meanwhile reaches the guest after the
        capture."""
        waited = False

        def wait_begins() -> None:
            nonlocal waited
            waited = True
            self._streams.hold_new_input()
            self._set_ready(refill=False)  # the spare is made from the snapshot: once it is stored

        started = time.monotonic()
        when = await until_settled(backend.vcpu_seconds, settle_limit(),
                                   [self._phases.lock.wanted, self._snapshots.wanted], waiting=wait_begins)
        if waited and (self._phases.phase != Phase.READY or self.machine.backend is not backend
                       or not backend.alive or self.machine.expect_exit):
            self._streams.release_input()
            self._snapshots.gone_while_settling()
            return False
        self._snapshots.settled(when, time.monotonic() - started if waited else 0.0)
        return True

    def _on_backend_event(self, event: BackendEvent, data: dict[str, Any]) -> None:
        self._events.publish(event.value, **data)
        machine, phase = self.machine, self._phases.phase
        backend = machine.backend
        if event == BackendEvent.POWERED_OFF and backend is not None and not machine.expect_exit:
            # The guest powered itself off (or answered ACPI): the backend waits; end it.
            machine.expect_exit = True
            self._spawn(self._guest_powered_off(backend, data))
        elif event == BackendEvent.RESET and phase in (Phase.RUNNING, Phase.READY) and machine.is_new_boot():
            assert self._spec is not None
            self._until_ready = None
            machine.begin_boot("guest reboot")
            self._phases.set(Phase.RUNNING, reason="guest reset")
            self._readiness.arm(self._spec, self._streams.hubs, self._disks.current)
        elif event == BackendEvent.EXITED and backend is not None and not machine.expect_exit:
            self._spawn(self._backend_crashed(backend))
        elif event == BackendEvent.IO_ERROR and data.get("action") == "stop" and phase in LIVE:
            self._readiness.disarm()
            self._phases.fail(Phase.ERROR, disk_io_error(data, self._paths))

    async def _guest_powered_off(self, backend: Backend, data: dict[str, Any]) -> None:
        async with self._phases.lock:
            if self.machine.backend is backend:
                await self.stop(graceful=False)
                self._phases.set(Phase.STOPPED, reason=data.get("reason", "guest-shutdown"))

    async def _backend_crashed(self, backend: Backend) -> None:
        async with self._phases.lock:
            if self.machine.backend is backend:
                self._readiness.disarm()
                self._phases.fail(Phase.CRASHED, await self.machine.crashed())
                self._free_live_ram()

    def _free_live_ram(self) -> None:
        """Its QEMU is gone: free a captured guest's RAM in a thread, beside what comes next."""
        if (ram := self._snapshots.take_live_ram()) is not None:
            self._spawn(asyncio.to_thread(ram.close))

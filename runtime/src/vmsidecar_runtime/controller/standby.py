"""A spare restore for the next recycle (the spec's ``standby``).

A recycle spends its time restoring: a new QEMU maps the snapshot and loads its device state
(0.06-0.09 s), then a restored guest's clock is set through its agent, which under TCG waits for
the guest to translate its code afresh (0.18 s for Debian). With a standby, that happens while a
lease runs: a second QEMU restores the snapshot into files of its own (``state/spare``, a run
directory of its own), its clock is set, and it runs on, idle and unattached, with its own NIC
filter and no forward. The recycle ends the lease's QEMU, moves the spare's overlay (and UEFI
vars) into the lease's places, binds its forwards and attaches the streams (``Boot._adopt``): no
QEMU starts, no clock waits, and the guest is Ready in the time the old one takes to stop.

The spare is a pristine guest nobody reaches: nothing of the running lease is in it (it comes from
the snapshot, not from the lease's guest), its sockets are private, and it has no forward (no port
anyone could reach it on) until the recycle adopts it (``Machine.adopt``). Whatever it does on its
own that a restored guest would not (power off, reset, panic, an I/O error, its QEMU's exit) ends
it; the recycle then restores as without a standby. Where two QEMUs of one runtime would share
something a lease reaches, there is no spare (``why_not``): the GPIO device (one vhost-user
backend per runtime), a native CAN bus (a host interface both would join).

What a pool owner pays (docs/decisions.md, "a spare restore for the next recycle"): a second QEMU
per pod, idle (its private memory: under TCG the translation cache, ~60 MB for Debian; its
copy-on-write pages) and the CPU of an idle guest.

``standby: parked`` goes half the way for a fraction of that: the second QEMU is started the same
way (its own overlay, run directory and NIC filter, the snapshot's RAM file mapped) and left
waiting for its incoming stream, nothing loaded and no guest CPU run. The recycle adopts it as a
spare, then loads the snapshot's device state into it, resumes it, and sets the guest's clock
after its Ready as a restore does (``Boot._adopt``): it saves the QEMU start (most of a templated
recycle under TCG, docs/performance.md) and costs a QEMU that has built its machine and idles
(~40 MB resident, PSS 28 MB; no CPU).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import shutil
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Literal

from vmsidecar_contract.errors import VmsidecarError
from vmsidecar_contract.spec import VmSpec

from ..backend import Backend, BackendEvent, EventSink
from ..backend.factory import supports_snapshots
from ..disk import chain_over, create_overlay
from ..plan import BootPlan, shared_with_another_qemu
from ..snapshots import Snapshot
from .guest_clock import correct_clock
from .machine import Machine
from .paths import RuntimePaths
from .snapshot_ops import SnapshotOps
from .snapshot_rules import never_snapshots

log = logging.getLogger(__name__)

#: what a spare guest does on its own that ends it: a restored guest that waits for a lease does none
ENDS_A_SPARE = frozenset({BackendEvent.POWERED_OFF, BackendEvent.RESET, BackendEvent.PANICKED,
                          BackendEvent.IO_ERROR, BackendEvent.EXITED})

StandbyStatus = Literal["off", "preparing", "ready", "parked", "none"]


def why_not(spec: VmSpec) -> str | None:
    """Why ``spec`` gets no spare restore: none of its boots restores (``snapshot: off``, a backend
    or an architecture without snapshots), or two QEMUs of one runtime would share what a lease
    reaches."""
    if (rule := never_snapshots(spec, supports_snapshots)) is not None:
        return rule[0]
    return shared_with_another_qemu(spec)


class _Relay:
    """A backend's event sink that can be pointed elsewhere: the spare's own handler, then the
    machine's once the spare is adopted."""

    def __init__(self, target: EventSink) -> None:
        self.target = target

    def __call__(self, event: BackendEvent, data: dict[str, Any]) -> None:
        self.target(event, data)


@dataclass
class Spare:
    """A restored guest that runs idle until a recycle adopts it, or (not ``loaded``) a parked QEMU
    that waits for the snapshot to be loaded into it."""

    spec: VmSpec
    snap: Snapshot
    plan: BootPlan
    backend: Backend
    relay: _Relay
    #: ``snapshot.clock`` of the boot that adopts it (set when it was made; it ran on since); None
    #: for a parked QEMU: its guest's clock is set after the recycle loads it
    clock: str | None

    @property
    def loaded(self) -> bool:
        """The snapshot is restored into it and its guest runs (``standby: true``)."""
        return self.clock is not None


class Standby:
    """At most one spare; made after a Ready, taken (or dropped) by the next boot."""

    def __init__(self, paths: RuntimePaths, machine: Machine, snapshots: SnapshotOps) -> None:
        self._paths = paths
        self._machine = machine
        self._snapshots = snapshots
        self._spare: Spare | None = None
        self._making: asyncio.Task[None] | None = None
        self._reason: str | None = None
        self._numbers = itertools.count(1)
        self._ending: set[asyncio.Task[None]] = set()

    def status(self, spec: VmSpec | None) -> tuple[StandbyStatus, str | None]:
        """``snapshot.standby`` and ``snapshot.standby_reason`` of ``GET /v1/vm`` under ``spec``."""
        if spec is None or spec.standby is False:
            return "off", None
        if self._spare is not None:
            return ("ready" if self._spare.loaded else "parked"), None
        if self._making is not None:
            return "preparing", None
        return "none", self._reason

    def refill(self, spec: VmSpec, after: Callable[[], Awaitable[None]]) -> None:
        """After a Ready: make a spare for the next recycle unless one is there or on its way, once
        ``after`` returns (the Ready guest's clock set: the spare's QEMU would compete with it)."""
        if spec.standby is False or self._spare is not None or self._making is not None:
            return
        if (why := why_not(spec)) is not None:
            self._reason = why
            return
        self._reason = None
        self._making = asyncio.create_task(self._make(spec, after))

    async def _make(self, spec: VmSpec, after: Callable[[], Awaitable[None]]) -> None:
        try:
            await after()
            accel = self._machine.accel
            parts = await self._snapshots.for_spare(spec, accel.accel) if accel is not None else None
            if parts is None:
                self._reason = "no sealed snapshot of this spec and image in the cache"
                return
            spare_dir = self._paths.spare
            await asyncio.to_thread(shutil.rmtree, spare_dir, True)
            self._remove_run_dirs()
            spare_dir.mkdir(parents=True)
            overlay = spare_dir / self._paths.overlay.name
            await create_overlay(parts.backing, overlay)
            run_dir = self._paths.run / f"spare{next(self._numbers)}"
            run_dir.mkdir(mode=0o700)
            relay = _Relay(lambda event, data: None)
            load = spec.standby is True  # else parked: nothing loaded until the recycle
            plan, backend = await self._machine.launch_spare(
                lambda: self._machine.new_plan(spec, overlay, chain_over(parts.backing), run_dir, spare_dir,
                                               parts.snap.memory, parts.ram, parts.check, spare=True),
                relay, load=load)
            clock: str | None = None
            if load:
                try:
                    await backend.resume()
                    clock = await correct_clock(parts.guest_agent, backend.guest_agent)
                except BaseException:
                    await backend.quit(timeout=1)
                    raise
            spare = Spare(spec, parts.snap, plan, backend, relay, clock)
            relay.target = lambda event, data: self._on_spare_event(spare, event)
            if not backend.alive:
                await backend.quit(timeout=1)
                self._reason = ("the spare guest's QEMU" if spare.loaded else "the parked QEMU") + " exited as it started"
                return
            self._spare = spare
            log.info("a %s of %s waits for the next recycle", describe(spare), parts.snap.path.name)
        except (VmsidecarError, OSError) as e:
            why = e.message if isinstance(e, VmsidecarError) else str(e)
            what = "spare restore" if spec.standby is True else "parked QEMU"
            self._reason = f"the {what} failed: {why}"
            log.warning("no %s: %s", what, why)
        finally:
            self._making = None

    def _on_spare_event(self, spare: Spare, event: BackendEvent) -> None:
        if event in ENDS_A_SPARE and self._spare is spare:
            self._spare = None
            self._reason = f"the {describe(spare)} ended on its own ({event.value}); the next recycle restores"
            log.warning("the %s ended: %s", describe(spare), event.value)
            self._end_in_background(spare)

    def _end_in_background(self, spare: Spare) -> None:
        task = asyncio.create_task(spare.backend.quit(timeout=1))
        self._ending.add(task)
        task.add_done_callback(self._ending.discard)

    async def take(self, spec: VmSpec, snap: Snapshot) -> Spare | None:
        """The spare, if it restores ``snap`` for ``spec`` and still runs (the caller adopts it);
        any other spare, or one still being made, is ended."""
        await self._stop_making()
        spare, self._spare = self._spare, None
        if spare is None:
            return None
        if spare.spec == spec and spare.snap.path == snap.path and spare.backend.alive:
            return spare
        self._reason = "the spare restored another spec or snapshot"
        await spare.backend.quit(timeout=1)
        return None

    def adopted(self, spare: Spare, on_event: EventSink) -> None:
        """``spare`` is the boot's now: its backend's events go to ``on_event``."""
        spare.relay.target = on_event

    async def _stop_making(self) -> None:
        task = self._making
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def drop(self, why: str) -> None:
        """End the spare (and one being made): the spec changed, or the runtime stops."""
        await self._stop_making()
        spare, self._spare = self._spare, None
        self._reason = why
        if spare is not None:
            await spare.backend.quit(timeout=1)
        for task in list(self._ending):
            with contextlib.suppress(Exception):
                await task

    async def kill(self) -> None:
        """SIGKILL the spare, whatever it was doing (the runtime's grace period is over)."""
        if self._spare is not None:
            await self._spare.backend.kill()

    def _remove_run_dirs(self) -> None:
        """The run directories of earlier spares whose QEMUs are gone (the adopted one's stays)."""
        live = self._machine.plan.run_dir if self._machine.plan is not None else None
        for old in self._paths.run.glob("spare*"):
            if old != live:
                shutil.rmtree(old, ignore_errors=True)


def describe(spare: Spare) -> str:
    """``spare`` in messages: a spare guest, or a parked QEMU."""
    return "spare guest" if spare.loaded else "parked QEMU"

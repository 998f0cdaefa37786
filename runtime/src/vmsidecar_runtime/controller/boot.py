"""How the guest boots on its disk: from a memory snapshot (restored now, or a spare restore made
while the last lease ran, ``standby.py``), or cold; and a capture's continuation.

``Boot`` runs the steps ``SnapshotOps`` decides on, with ``Machine`` for the backend and ``Disks``
for the overlay. It reports the moment the guest runs through ``running`` (the controller's phase
Running); every other outcome is returned: whether the guest is Ready already (restored) or its
readiness is to be watched (cold). A restored guest's clock is set after its Ready, and
``clock_settled`` is what a claim waits for.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

from vmsidecar_contract.errors import HostError, VmsidecarError
from vmsidecar_contract.spec import VmSpec

from .. import metrics
from ..backend import Backend
from ..plan import RamFile
from ..ports import PortTaken
from ..snapshots import CONSOLES, Snapshot
from .capture import Capture
from .disks import Disks
from .guest_clock import already_set, correct_clock, has_guest_agent, until_set
from .machine import Machine
from .snapshot_ops import SnapshotOps
from .standby import Spare, Standby, describe
from .streams import GuestStreams

log = logging.getLogger(__name__)


class Boot:
    """Restore or cold boot, and the capture of a pristine boot."""

    def __init__(self, disks: Disks, streams: GuestStreams, machine: Machine, snapshots: SnapshotOps,
                 standby: Standby, running: Callable[[], None], spawn: Callable[[Coroutine[Any, Any, None]], None]) -> None:
        self._disks = disks
        self._streams = streams
        self._machine = machine
        self._snapshots = snapshots
        self._standby = standby
        self._running = running
        self._spawn = spawn
        #: set unless a new boot's restore is under way whose guest's clock is still to be set
        #: (``clock_settled``); each boot has its own, so a clock whose event is no longer this one
        #: belongs to an earlier boot
        self._clock_set = already_set()

    async def clock_settled(self) -> None:
        """Return once the restore under way, if any, has set its guest's clock (or failed to, or did
        not restore): a claim waits for it, so nothing of a lease reaches a guest on a stale clock."""
        await until_set(self._clock_set)

    async def start(self, spec: VmSpec, *, until: asyncio.Event | None = None) -> bool:
        """Boot ``spec`` on the current disk: restore the snapshot when this fresh overlay of the
        spec's image has one (True: the guest is Ready), else cold (False: watch its readiness).
        ``until``: the ending of the lease whose boot this is (a snapshot_source's fetch stops then).

        :raise VmsidecarError: the guest cannot start (the caller stops what is left and fails).
        """
        self._clock_set = already_set()  # (an earlier boot's clock never holds this one's claims)
        accel = self._machine.choose_accel(spec)
        await self._snapshots.drop_staging()  # an earlier boot's capture that never happened
        snap = self._snapshots.plan(spec, accel.accel)
        if snap is not None and (spare := await self._standby.take(spec, snap)) is not None:
            adopted = await self._adopt(snap, spare)
            if adopted:
                metrics.snapshot_lookup("hit")
                return True
            if adopted is None:
                await self._cold(spec)
                return False
        if snap is None:  # a cache miss: the spec's snapshot_source may have one
            snap = await self._snapshots.from_source(spec, until=until)
        if snap is not None and await self._restore(spec, snap):
            metrics.snapshot_lookup("hit")
            return True
        await self._cold(spec)
        return False

    async def _cold(self, spec: VmSpec) -> None:
        """Boot the guest from its disk; the readiness watch decides when it is Ready."""
        overlay = await self._disks.overlay()
        ram = await self._snapshots.cold_ram()  # a templated capture's RAM file, if this boot captures
        self._machine.begin_boot("power-on")
        self._snapshots.booting_cold()
        await self._launch(spec, overlay, ram=ram)

    async def _launch(self, spec: VmSpec, overlay: Path, incoming: Path | None = None,
                      ram: RamFile | None = None, incoming_check: asyncio.Future[str | None] | None = None) -> None:
        await self._machine.launch(spec, overlay, self._disks.chain(overlay), incoming, ram, incoming_check)
        self._running()

    async def _restore(self, spec: VmSpec, snap: Snapshot, *, new_boot: bool = True) -> bool:
        """Run from ``snap`` (a new boot, or the captured boot continuing); on refusal discard it
        and return False (the caller boots cold). A new boot is Ready before its guest's clock is
        set (``_clock_after_ready``); a claim that comes meanwhile waits for the clock.

        :raise HostError: the host's problem, which a cold boot would meet too (no room or no
            permission for the overlay, a forward's port taken): the snapshot stays.
        """
        clock_set: asyncio.Event | None = None
        if new_boot and has_guest_agent(snap):
            self._clock_set = clock_set = asyncio.Event()
        try:
            if not await self._restore_steps(spec, snap, new_boot=new_boot, hold_input=clock_set is not None):
                return False
            backend = self._machine.backend
            assert backend is not None
            if clock_set is not None:
                self._clock_after_ready(backend, clock_set)
                clock_set = None  # (set by the clock's task)
            if new_boot:
                self._overlay_ahead(snap)
            return True
        finally:
            if clock_set is not None:  # no clock to wait for: the restore did not happen
                clock_set.set()
                self._streams.release_input()

    async def _restore_steps(self, spec: VmSpec, snap: Snapshot, *, new_boot: bool, hold_input: bool) -> bool:
        """``hold_input``: console input waits in the hubs from before QEMU runs (until the clock is set)."""
        started = time.monotonic()
        # What QEMU opens as it starts (the frozen overlay) is checked before it starts; the RAM file
        # and the memory stream (most of the hashing) while it starts: it is handed the stream only
        # once they passed, and never runs a guest from a broken snapshot.
        if not await self._snapshots.verify(snap):
            if new_boot:
                metrics.snapshot_lookup("seal_broken")
            return False
        # a fresh overlay on the snapshot's frozen disk (checked above): a failure is the state
        # directory's (no room, no permission), which a cold boot meets the same; not the snapshot's
        overlay = await self._disks.overlay(self._snapshots.overlay_backing(snap))
        deferred_check = self._snapshots.check_deferred(snap)
        try:
            # a new boot shows the pristine boot's scrollback (a capture continues the boot it interrupted)
            if new_boot:
                self._begin_restored_boot(snap)
            if hold_input:  # (after the new boot's start, which drops what was held for the last one)
                self._streams.hold_new_input()
            await self._launch(spec, overlay, snap.memory, self._snapshots.restore_ram(snap), deferred_check)
        except PortTaken:  # the host's: a cold boot fails the same, and the snapshot is not at fault
            await self._machine.stop()
            raise
        except VmsidecarError as e:
            await self._machine.stop()
            if (broken := await deferred_check) is not None:
                await self._snapshots.seal_broken(snap, broken)
                if new_boot:
                    metrics.snapshot_lookup("seal_broken")
            else:
                await self._snapshots.refused(snap, e, just_captured=not new_boot)
                if new_boot:
                    metrics.snapshot_lookup("refused")
            return False
        assert self._machine.backend is not None
        if new_boot:
            self._snapshots.restored_new_boot(snap, started)
        else:
            await self._snapshots.restored(snap, started, self._machine.backend.guest_agent)
        return True

    def _clock_after_ready(self, backend: Backend, clock_set: asyncio.Event) -> None:
        """Set the restored guest's clock through its agent while the guest is Ready: its console
        input waits until then (held since before QEMU ran), and so does a claim
        (``clock_settled``), and with it all a lease can do. Under TCG the agent's first round trip
        is most of a Debian recycle (docs/decisions.md, "Ready before the clock"); under KVM it
        takes milliseconds."""
        async def set_clock() -> None:
            clock = "failed: the runtime stopped setting it"
            try:
                clock = await correct_clock(True, backend.guest_agent)
            except Exception as e:  # (say, the agent's socket reset as its QEMU went): claims go on
                log.warning("the restored guest's clock was not set: %s", type(e).__name__, exc_info=True)
                clock = f"failed: {type(e).__name__} on the guest agent's socket"
            finally:
                clock_set.set()
                if self._clock_set is clock_set:  # (else the next boot began: its input and state are its own)
                    self._streams.release_input()
                    self._snapshots.clock_set(clock)

        self._spawn(set_clock())

    async def _adopt(self, snap: Snapshot, spare: Spare) -> bool | None:
        """Run the spare restore of ``snap`` as this boot, or restore ``snap`` into a parked QEMU
        (``standby.py``); False when it cannot be (it is ended, and the caller restores as without
        it), None when ``snap`` failed its seal check (it is ended and ``snap`` removed: the caller
        boots cold)."""
        started = time.monotonic()
        # The spare maps the template's RAM file privately since before the lease: the pages it has
        # not touched yet still read the file, which the lease's QEMU (stopped now) held read-write.
        # So its seal is checked as a restore's would be (a stat compare unless something changed).
        intact = await self._snapshots.verify(snap)  # (a broken one is removed, saying why)
        if intact and (broken := await self._snapshots.check_deferred(snap)) is not None:
            await self._snapshots.seal_broken(snap, broken)
            intact = False
        if not intact:
            await spare.backend.quit(timeout=1)
            metrics.snapshot_lookup("seal_broken")
            return None
        try:
            self._disks.adopt_spare(spare.plan.disk_chain)
        except OSError as e:
            log.warning("the spare restore's files could not be moved into the lease's (%s); restoring", e)
            await spare.backend.quit(timeout=1)
            self._disks.drop_overlays()
            return False
        self._begin_restored_boot(snap)
        clock_set: asyncio.Event | None = None
        if not spare.loaded and has_guest_agent(snap):  # its clock is set after Ready, as a restore's
            self._clock_set = clock_set = asyncio.Event()
            self._streams.hold_new_input()
        self._standby.adopted(spare, self._machine.event_sink)  # from now on its exit is this boot's crash
        try:
            await self._machine.adopt(spare.plan, spare.backend)
            if not spare.loaded:
                await spare.backend.load()
                await spare.backend.resume()
            if not spare.backend.alive:
                raise HostError("its QEMU exited as the recycle took it")
        except Exception as e:  # whatever it was (its QEMU gone mid-way: a QMP error too), this boot restores
            log.warning("the %s could not take over (%s); restoring", describe(spare), e)
            await self._machine.stop()
            self._disks.drop_overlays()
            if clock_set is not None:  # (the restore that follows holds its own)
                clock_set.set()
                self._streams.release_input()
            return False
        self._running()
        if spare.clock is not None:
            self._snapshots.adopted(snap, started, spare.clock)
        else:
            self._snapshots.restored_new_boot(snap, started)
            if clock_set is not None:
                self._clock_after_ready(spare.backend, clock_set)
        self._overlay_ahead(snap)  # for a restore, should the next spare not be there
        return True

    def _overlay_ahead(self, snap: Snapshot | None) -> None:
        """Once this restored guest's clock is set, make the next restore's overlay over ``snap``'s
        frozen disk (``Disks.prepare_ahead``): the next recycle does not wait for qemu-img. None:
        over the frozen disk of the capture being stored (this boot went on after it)."""
        base = self._disks.current

        async def prepare() -> None:
            await self.clock_settled()
            stored = snap or await self._snapshots.stored_snapshot()
            if stored is not None:
                await self._disks.prepare_ahead(self._snapshots.overlay_backing(stored, base))

        self._spawn(prepare())

    def _begin_restored_boot(self, snap: Snapshot) -> None:
        """A new boot from ``snap``: its own counter and timings, the pristine boot's scrollback."""
        self._machine.begin_boot("restore", firmware=False)
        self._streams.preload({name: snap.console(name) for name in CONSOLES})

    async def capture(self, spec: VmSpec, key: str, backend: Backend) -> bool:
        """At the first Ready of a pristine cold boot: snapshot the guest, then let the same boot go
        on: in its own process where the backend can (``continues_after_save``), else restored from
        the snapshot in a new one (which proves it loads). Ready at once (True) unless the guest had
        to boot cold again (False)."""
        assert self._machine.plan is not None
        await self._streams.hold_input()  # what a console client types meanwhile waits for the guest
        top: Path | None = None
        try:
            top = await self._new_top(backend) if backend.continues_after_save else None  # before the pause
            capture = await self._snapshots.save(key, backend)
            if capture is None:  # the backend cannot snapshot this guest: it runs on
                return True
            try:
                if top is not None:
                    went_on = await self._continue_in_place(spec, capture, backend, top)
                    if went_on is not None:
                        return went_on
                await self._machine.stop()  # its last output is read first: it belongs in the snapshot
                consoles = self._streams.boot_outputs()
                snap = await self._snapshots.commit(capture, consoles)
            except Exception:  # a bug's (the caller's net stops the guest): nothing staged stays
                await self._snapshots.drop_unfinished(capture)
                raise
            if snap is not None and await self._restore(spec, snap, new_boot=False):
                self._snapshots.captured(capture, snap)
                return True
            await self._cold(spec)
            return False
        finally:
            if top is not None:
                top.unlink(missing_ok=True)  # made for a guest that did not go on in its process
            self._streams.release_input()

    async def _new_top(self, backend: Backend) -> Path | None:
        """The overlay the captured guest goes on with (``Disks.prepare_freeze``), made while it
        runs; None when it cannot be (logged: the guest is restored from the snapshot instead)."""
        try:
            return await self._disks.prepare_freeze(await backend.disk_size())
        except HostError as e:
            _cannot_go_on(e)
            return None

    async def _continue_in_place(self, spec: VmSpec, capture: Capture, backend: Backend, top: Path) -> bool | None:
        """Copy the snapshot out of the captured guest's reach while it is paused (sealed), then let
        it run on in its process, its writes going to ``top``, a new overlay over the frozen disk (no
        new process, no restore: 0.1 s less at a cold start's Ready, and the first lease's guest
        keeps what TCG translated), the snapshot written into the store beside it. Its RAM is
        copied while its disk switches.

        The snapshot is first restored at the next recycle; a snapshot QEMU refuses then is
        discarded and that boot is cold (``Boot._restore``). Returns None when the backend cannot
        switch the disk (the caller stops it and restores instead), else as ``capture``.
        """
        ram_copy = self._snapshots.copy_ram_out(capture)
        try:
            frozen = await self._disks.freeze_live(top, backend.continue_on)
        except HostError as e:
            _cannot_go_on(e)
            await self._snapshots.abandon_ram_copy(ram_copy)
            return None
        except Exception:  # a bug's: the RAM's copy ends before the capture is dropped (``capture``)
            await self._snapshots.abandon_ram_copy(ram_copy)
            raise
        await self._streams.output_read()  # what the guest wrote before it paused belongs in the snapshot
        consoles = self._streams.boot_outputs()
        copied = await self._snapshots.freeze(capture, frozen, ram_copy)
        if copied is not None:  # stored whether the guest resumes or not: what it is made of is copied
            self._snapshots.store_in_background(capture, copied, consoles)
        try:
            await backend.resume()
        except VmsidecarError as e:
            log.warning("the captured guest did not resume (%s); booting it cold again", e.message)
            await self._machine.stop()
            if (ram := self._snapshots.take_live_ram()) is not None:
                await asyncio.to_thread(ram.close)
            self._disks.drop_overlays()  # the disk it booted: a cold boot starts from the image
            await self._cold(spec)
            return False
        if copied is not None:
            assert self._machine.backend is not None
            # the guest's clock stood still while it was paused: set like a restored guest's
            await self._snapshots.went_on(capture, self._machine.backend.guest_agent)
            self._overlay_ahead(None)  # for the pod's first recycle, its first restore
        return True


def _cannot_go_on(error: HostError) -> None:
    log.warning("the captured boot cannot go on in its process (%s); it is restored from the snapshot", error.message)

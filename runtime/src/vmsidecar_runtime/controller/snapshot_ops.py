"""Leases without boots: capture a pristine guest at its first Ready, restore it afterwards.

``SnapshotOps`` decides when a boot restores and when it captures, and why not (``info``, the
``snapshot`` field of ``GET /v1/vm``); it checks, stores and discards the snapshots. ``Boot`` runs
the steps it decides on. The rules:

- **Restore** when a boot starts on a fresh overlay of the spec's own image (a cold start or a
  recycle, not a flashed disk, not a power cycle within a lease), the backend can restore memory
  (``supports_snapshots``) and the cache has the snapshot for this spec, image, QEMU and
  accelerator (or the spec's ``snapshot_source``: ``source_fetch.py``). A refused snapshot is
  discarded: the guest boots cold.
- **Capture** at the first Ready of such a cold boot, unless a lease has claimed the guest (its
  activity must never reach the snapshot; a claim waits for a capture under way). The guest is
  paused, its state written, QEMU stopped, the overlay frozen into the snapshot; the same boot
  continues from it, which proves it loads. Consoles keep their clients and scrollback.
- **Form** (``snapshots.py``): templated unless the spec or the runtime rules it out (the reason
  is ``info.form_reason``). A cold boot that is to capture a templated snapshot runs on a shared
  memfd (``capture_ram.py``): the capture writes device state and copies that RAM into the snapshot.
- **Clock** (``guest_clock.py``): the capture records whether the guest held the agent's port open;
  every restore of a snapshot with an agent sets the guest's clock to the host's before Ready.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import shutil
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vmsidecar_contract.errors import HostError, ImageError, VmsidecarError
from vmsidecar_contract.spec import VmSpec
from vmsidecar_contract.state import SnapshotInfo

from .. import metrics
from ..backend import Backend
from ..backend.factory import supports_snapshots
from ..backend.guest_agent import GuestAgent
from ..capture_ram import CaptureRam, FrozenRam, copy_ram
from ..disk import DiskImage
from ..plan import RamFile
from ..snapshot_identity import SnapshotIdentity, identify
from ..snapshots import STREAM, TEMPLATED, Snapshot, SnapshotMeta, SnapshotStore, snapshot_form
from .capture import Capture, FrozenCapture, Staging
from .disks import Disks
from .guest_clock import CLOCK_NO_AGENT, CLOCK_SETTING, correct_clock, has_guest_agent
from .lease import LeaseEnded, unless_ended
from .paths import RuntimePaths
from .phase import unexpected
from .snapshot_rules import LEASE_BOUND, no_snapshot
from .source_fetch import SourceFetch

log = logging.getLogger(__name__)


#: seconds between two passes of a capturing boot's ``FrozenRam.mirror``, at least
MIRROR_INTERVAL_S = 0.25
#: ... and at least this many times the last pass's own time: a pass over a guest's RAM scattered in
#: 16,000 extents takes ~0.1 s even when nothing is new, and the mirror must not take a core from a
#: booting guest (at most 1 / (1 + MIRROR_IDLE_FACTOR) of one)
MIRROR_IDLE_FACTOR = 4

#: a key whose fresh snapshots were refused at their first load this many times is not captured again
FRESH_REFUSALS = 2


@dataclass(frozen=True)
class SpareParts:
    """What a spare restore starts from (``SnapshotOps.for_spare``)."""

    snap: Snapshot
    #: the snapshot's frozen overlay, which the spare's own overlay is made over
    backing: DiskImage
    ram: RamFile | None
    #: the seal check of the RAM file and the memory stream, under way (``BootPlan.incoming_check``)
    check: asyncio.Future[str | None]
    #: the guest held the agent's port open at capture: its clock can be set
    guest_agent: bool


class SnapshotOps:
    """When to restore or capture, why not, and the snapshot store behind it."""

    def __init__(self, paths: RuntimePaths, disks: Disks,
                 backend_supports_snapshots: Callable[[str], bool] = supports_snapshots) -> None:
        self._paths = paths
        self._disks = disks
        self._supports = backend_supports_snapshots
        self._store = SnapshotStore(paths.cache)
        self.info = SnapshotInfo()
        #: key of the snapshot the current cold boot should capture at its first Ready
        self._capture_key: str | None = None
        #: key of the snapshot the current boot restores or captures
        self._planned_key: str | None = None
        #: keys QEMU could not snapshot (a device that blocks migration): not retried
        self._uncapturable: dict[str, str] = {}
        #: the last plan found no snapshot because of the lease's disk (flashed, or changed)
        self._lease_bound = False
        #: keys captured in place whose snapshot no restore has loaded yet
        self._unproven: set[str] = set()
        #: key -> how many of its snapshots this process captured were refused at their first load
        self._fresh_refusals: dict[str, int] = {}
        #: set while a capture runs (it started before any lease had the guest); a claim waits for it
        self._capturing: asyncio.Event | None = None
        #: a claim waits for the capture: one waiting for its guest to settle captures at once
        self.wanted = asyncio.Event()
        #: what the current boot's snapshot must match (its key and the fields behind it)
        self._identity: SnapshotIdentity | None = None
        #: the snapshot this boot fetched from the spec's snapshot_source (its restore is "registry_warm")
        self._fetched: Path | None = None
        #: the spec's snapshot_source, fetched while the image is pulled (``Power`` starts it) or after
        self.source = SourceFetch(self._store, backend_supports_snapshots)
        #: the form the current boot's snapshot takes
        self._form = TEMPLATED
        #: the staging directory the current cold boot is to be captured into (a templated capture)
        self._staged: Staging | None = None
        #: the RAM of a guest that went on in its process after a templated capture: held while its
        #: QEMU runs, so that QEMU's exit, which a recycle waits for, does not free it (1.7 GB of
        #: written RAM took 0.3 s) (``take_live_ram``)
        self._live_ram: CaptureRam | None = None
        #: the snapshot of a guest that went on after its capture, being written into the store
        #: after Ready (``store_in_background``); awaited before the store is read again (``stored``)
        self._storing: asyncio.Task[None] | None = None
        #: what the last store in the background stored (``stored_snapshot``)
        self._last_stored: Snapshot | None = None
        #: allocates the frozen copy's pages as the capturing boot's RAM grows (``FrozenRam.mirror``)
        self._mirroring: asyncio.Task[None] | None = None

    def _why(self, reason: str) -> None:
        self.info = self.info.model_copy(update={"reason": reason})

    # ---- decisions -----------------------------------------------------------------------
    def _key(self, spec: VmSpec, accel: str) -> str | None:
        """The key for booting ``spec`` on the spec's own image now, or None (reason recorded)."""
        base = self._disks.current
        why_not = no_snapshot(spec, self._disks, self._paths, self._supports)
        self._lease_bound = why_not is not None and why_not[1] in LEASE_BOUND
        if why_not is not None:
            self._why(why_not[0])
            metrics.snapshot_lookup(why_not[1])
            return None
        assert base is not None
        try:
            self._identity = identify(spec, base, accel)
        except (ImageError, HostError) as e:  # the boot fails with this reason (readiness watch, QEMU's argv)
            self._why(e.message)
            metrics.snapshot_lookup("readiness_invalid")
            return None
        self._form, form_reason = snapshot_form(spec)
        self.info = self.info.model_copy(update={"form": self._form, "form_reason": form_reason})
        return self._identity.key

    def plan(self, spec: VmSpec, accel: str) -> Snapshot | None:
        """Before a boot: the snapshot to restore, or None (and whether to capture one)."""
        self._capture_key = None
        self._identity = None
        self._fetched = None
        self.info = self.info.model_copy(update={"clock": None, "source_refusal": None, "form": None,
                                                 "form_reason": None, "restored_ahead": False,
                                                 "captured_when": None, "settle_seconds": None})
        key = self._key(spec, accel)
        self._planned_key = key
        snap = self._store.find(key) if key is not None else None
        # never evicted while in use; a boot of the lease's own disk keeps the spec's snapshot, which
        # the next recycle restores (a lease's pulls would otherwise evict it)
        keep = snap if snap is not None or not self._lease_bound else self._store.held_snapshot
        self._store.hold([self._disks.base, self._disks.current], keep)
        if key is None:
            return None
        self.info = self.info.model_copy(update={"available": snap is not None, "size": snap.size if snap else None})
        if snap is not None:
            self.source.drop()
            return snap
        if key in self._uncapturable:
            self._why(self._uncapturable[key])
            metrics.snapshot_lookup("uncapturable")
        else:
            self._capture_key = key
            self._why("no snapshot yet for this spec and image: this boot captures one at Ready")
            metrics.snapshot_lookup("none_cached")
        return None

    async def from_source(self, spec: VmSpec, *, until: asyncio.Event | None = None) -> Snapshot | None:
        """On a cache miss (this boot was to capture): the snapshot of the spec's ``snapshot_source``
        in the cache, or None (refusal recorded). A flashed or pulled disk never gets here (``_key``).
        ``until``: the ending of the lease whose boot this is; the fetch is given up when it is set
        (the boot holds the power lock, which that lease's recycle and the next claim wait for)."""
        source, key, identity, base = spec.snapshot_source, self._capture_key, self._identity, self._disks.current
        if source is None or key is None or identity is None or base is None:
            self.source.drop()
            return None
        # the registry code (oras, requests: 0.08 s of imports) only when a source is configured
        from ..oci.snapshot_fetch import SourceRefused
        try:
            snap = await unless_ended(self.source.snapshot(source, identity, base), until)
        except LeaseEnded:
            self._why(f"the lease whose boot this is ended during the fetch from the snapshot_source {source}")
            return None
        except SourceRefused as e:
            self.info = self.info.model_copy(update={"source_refusal": e.code, "reason": f"no snapshot from the "
                                                     f"snapshot_source {source}: {e.message}; this boot captures one at Ready"})
            return None
        self._fetched, self._capture_key = snap.path, None
        self._store.hold([self._disks.base, self._disks.current], snap)  # never evicted while in use
        self.info = self.info.model_copy(update={"available": True, "size": snap.size})
        return snap

    def take_capture(self) -> str | None:
        """At a boot's Ready: the key this boot is to capture, or None (asked once per boot)."""
        key, self._capture_key = self._capture_key, None
        return key

    async def cold_ram(self) -> RamFile | None:
        """Before a cold boot that captures a templated snapshot: its RAM (a shared memfd, copied into the
        staging directory at the capture), else None. Drops an earlier cold boot's uncaptured staging."""
        await self.drop_staging()
        if self._capture_key is None or self._form != TEMPLATED:
            return None
        try:
            snap = await asyncio.to_thread(self._store.staging, self._capture_key)
        except OSError as e:  # the boot goes on without a capture: the next one tries again
            self._capture_key = None
            self._not_staged(e)
            return None
        ram = CaptureRam(f"vmsidecar-ram-{self._capture_key}")
        self._staged = Staging(snap, ram, FrozenRam(f"vmsidecar-frozen-{self._capture_key}", ram))
        self._mirroring = asyncio.create_task(self._mirror(self._staged.frozen))
        return RamFile(ram.qemu_path, share=True, fd=ram.fd)

    @staticmethod
    async def _mirror(frozen: FrozenRam) -> None:
        """Until stopped, every ``MIRROR_INTERVAL_S`` or more: allocate the frozen copy's pages as the
        guest's RAM grows. A pass under way when stopped ends first: nothing closes the memfds under it."""
        took = 0.0
        while True:
            await asyncio.sleep(max(MIRROR_INTERVAL_S, MIRROR_IDLE_FACTOR * took))
            started = time.monotonic()
            mirrored = asyncio.ensure_future(asyncio.to_thread(frozen.mirror))
            try:
                await asyncio.shield(mirrored)
            except asyncio.CancelledError:
                with contextlib.suppress(OSError):
                    await mirrored
                raise
            except OSError as e:  # the pause's copy allocates what is left, or says why it cannot
                log.warning("the capture's copy of the guest's RAM cannot be prepared (%s); it is made in the "
                            "capture's pause", e)
                return
            took = time.monotonic() - started

    def _cancel_mirror(self) -> asyncio.Task[None] | None:
        """Stop the mirror (a pass under way ends before the memfds can close); the task, to await."""
        task, self._mirroring = self._mirroring, None
        if task is not None:
            task.cancel()
        return task

    async def _stop_mirror(self) -> None:
        if (task := self._cancel_mirror()) is not None:
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def drop_staging(self) -> None:
        """Remove the staging directory of a capture that will not happen (the boot running on its
        RAM keeps its mapping: the memory goes when that QEMU ends)."""
        await self.stored()
        await self._stop_mirror()
        staged, self._staged = self._staged, None
        if staged is not None:
            staged.close()
            await self._store.discard(staged.snap)

    async def stored(self) -> None:
        """Return once no snapshot is being written into the store (a boot that may restore it, or
        the runtime's exit, waits for it)."""
        while (task := self._storing) is not None:
            await asyncio.wait([task])
            if self._storing is task:
                self._storing = None

    async def stored_snapshot(self) -> Snapshot | None:
        """Once the capture being written into the store is there: its snapshot (None: it was not
        stored, or none was being written)."""
        await self.stored()
        snap, self._last_stored = self._last_stored, None
        return snap

    def abandon_capture(self) -> None:
        """A lease claimed the guest before its first Ready: this boot is not captured."""
        self._abandon("a lease was handed out before this boot was Ready, so it is not captured (the lease may "
                      "have changed the guest); the next pristine boot, after the lease's recycle, captures it")

    def not_ready(self) -> None:
        """This boot's readiness failed (the guest runs on, to be looked at): it is not captured, and
        the copy of its RAM allocated for the capture is let go."""
        self._abandon("this boot did not get Ready, so it is not captured; the next boot that does captures it")

    def gone_while_settling(self) -> None:
        """The guest powered off, rebooted, crashed or failed while it settled: it is not captured."""
        self._abandon("the guest stopped, rebooted or failed before it settled, so it is not captured; the next "
                      "pristine boot that settles is")

    def _abandon(self, reason: str) -> None:
        self._cancel_mirror()  # a pass under way ends before the close below returns (FrozenRam's lock)
        self._capture_key = None
        staged, self._staged = self._staged, None
        if staged is not None:  # the guest keeps its mapping; the memory goes when its QEMU ends
            staged.close()
            self._store.discard_now(staged.snap)
        self._why(reason)

    @contextlib.contextmanager
    def capturing(self) -> Iterator[None]:
        """Marks a capture under way, from the wait for its guest to settle (``capture_finished``
        waits for it)."""
        self._capturing = asyncio.Event()
        self.wanted.clear()
        try:
            yield
        finally:
            self._capturing.set()
            self._capturing = None

    @property
    def storing(self) -> bool:
        """``snapshot.storing``: this boot's capture is under way (its guest settling, or paused) or
        being written into the store."""
        return self._capturing is not None or (self._storing is not None and not self._storing.done())

    async def capture_finished(self) -> None:
        """Return once no capture is under way (a claim waits: the lease must not act during one);
        one waiting for its guest to settle is taken at once."""
        while self._capturing is not None:
            self.wanted.set()
            await self._capturing.wait()

    def settled(self, when: str, seconds: float) -> None:
        """Why and after how long the capture's wait for its guest to settle ended (``settle.py``)."""
        self.info = self.info.model_copy(update={"captured_when": when, "settle_seconds": round(seconds, 3)})

    # ---- restore -------------------------------------------------------------------------
    def booting_cold(self) -> None:
        self.info = self.info.model_copy(update={"boot": "cold"})

    def overlay_backing(self, snap: Snapshot, base: DiskImage | None = None) -> DiskImage:
        """The snapshot's frozen overlay, as the disk the restored boot's overlay is made over (the
        snapshot of ``base``, by default the current disk)."""
        base = base or self._disks.current
        assert base is not None
        return DiskImage(snap.disk, "qcow2", base.digest, base.source)

    async def verify(self, snap: Snapshot) -> bool:
        """Check ``snap``'s seal before QEMU starts, but for its RAM file and memory stream, which QEMU
        reads only once handed them (:meth:`check_deferred`); a broken one is removed (False: cold)."""
        assert self._disks.current is not None
        broken = await asyncio.to_thread(self._store.verify, snap, self._disks.current, defer_loaded=True)
        if broken is None:
            return True
        await self.seal_broken(snap, broken)
        return False

    def check_deferred(self, snap: Snapshot) -> asyncio.Future[str | None]:
        """The seal check of ``snap``'s RAM file and memory stream, started now to run while QEMU
        starts (None: they hold, else why not); the backend hands QEMU the stream only once it
        resolved to None (``BootPlan.incoming_check``)."""
        return asyncio.ensure_future(asyncio.to_thread(self._store.verify_deferred, snap))

    async def seal_broken(self, snap: Snapshot, broken: str) -> None:
        """``snap`` failed its seal check (QEMU, if it was started, is stopped): remove it."""
        await self._not_restored(snap, f"the snapshot failed its seal check: {broken}; it was removed")

    async def refused(self, snap: Snapshot, error: VmsidecarError, *, just_captured: bool = False) -> None:
        """The backend refused ``snap`` (it is stopped): discard it. ``just_captured``: the capture's
        own restore. A key whose snapshots this process captured were refused at their first load
        ``FRESH_REFUSALS`` times is not captured again: the next capture would be refused too, and
        a capture whose restore fails boots cold and captures again, without end."""
        key = snap.path.name
        fresh = just_captured or key in self._unproven
        self._unproven.discard(key)
        await self._not_restored(snap, f"the snapshot was refused ({error.message}); it was discarded")
        if fresh:
            self._fresh_refusals[key] = self._fresh_refusals.get(key, 0) + 1
            if self._fresh_refusals[key] >= FRESH_REFUSALS:
                self._uncapturable[key] = (f"QEMU refused twice to load this guest's snapshot right after capturing it "
                                           f"({error.message}); this runtime boots it cold from now on")
                self._why(self._uncapturable[key])
                self._capture_key = None

    async def _not_restored(self, snap: Snapshot, what: str) -> None:
        """Remove ``snap`` and the overlay made over its frozen disk; the cold boot that follows captures anew."""
        log.warning("memory snapshot %s not restored: %s; booting cold", snap.path.name, what)
        self._paths.overlay.unlink(missing_ok=True)
        await self._store.discard(snap)
        self.info = SnapshotInfo(boot="cold", reason=f"{what} and a new one is captured at Ready",
                                 form=self.info.form, form_reason=self.info.form_reason)
        self._capture_key = self._planned_key

    async def restored(self, snap: Snapshot, started: float, agent: GuestAgent | None) -> None:
        """The captured boot runs on from ``snap`` in a new process: correct its clock (through the
        backend's ``agent``), record the restore."""
        seconds = time.monotonic() - started
        clock = await correct_clock(has_guest_agent(snap), agent)
        self._record_restore(snap, seconds, clock, new_boot=False)

    def restored_new_boot(self, snap: Snapshot, started: float) -> None:
        """A new boot runs from ``snap``: record the restore, its clock being set
        (``CLOCK_SETTING``, then :meth:`clock_set`) when the snapshot's guest has an agent."""
        clock = CLOCK_SETTING if has_guest_agent(snap) else CLOCK_NO_AGENT
        self._record_restore(snap, time.monotonic() - started, clock, new_boot=True)

    def clock_set(self, clock: str) -> None:
        """What became of the restored guest's clock (``correct_clock``'s outcome)."""
        self.info = self.info.model_copy(update={"clock": clock})

    def adopted(self, snap: Snapshot, started: float, clock: str) -> None:
        """The guest of a spare restore of ``snap`` is this boot's (its clock was set when it was made)."""
        self._record_restore(snap, time.monotonic() - started, clock, new_boot=True, ahead=True)

    def _record_restore(self, snap: Snapshot, seconds: float, clock: str, *, new_boot: bool,
                        ahead: bool = False) -> None:
        self._unproven.discard(snap.path.name)  # it loads
        self._fresh_refusals.pop(snap.path.name, None)
        update: dict[str, Any] = {"available": True, "restore_seconds": round(seconds, 3), "clock": clock,
                                  "restored_ahead": ahead}
        if (meta := snap.meta()) is not None:
            update["form"] = meta.form
        if new_boot:
            update |= {"boot": "registry_warm" if snap.path == self._fetched else "restored", "reason": None}
            metrics.snapshot_restore.observe(update["restore_seconds"])
        self.info = self.info.model_copy(update=update)

    async def for_spare(self, spec: VmSpec, accel: str) -> SpareParts | None:
        """What a spare restore of ``spec`` (``standby.py``) starts from: the cache's sealed snapshot
        for the spec's image, its frozen overlay, its RAM and the deferred seal check; None when
        there is none (or its seal fails: the next boot that looks finds and removes it). Records
        nothing: the current boot's state stays its own."""
        await self.stored()
        base = self._disks.base
        if base is None:
            return None
        try:
            snap = self._store.find(identify(spec, base, accel).key)
        except (ImageError, HostError):
            return None
        if snap is None or await asyncio.to_thread(self._store.verify, snap, base, defer_loaded=True) is not None:
            return None
        return SpareParts(snap, self.overlay_backing(snap, base), self.restore_ram(snap), self.check_deferred(snap),
                          has_guest_agent(snap))

    # ---- capture -------------------------------------------------------------------------
    async def save(self, key: str, backend: Backend) -> Capture | None:
        """Pause the guest and write its state; None when the backend cannot (recorded, never retried
        for ``key``; the guest runs on)."""
        await self._stop_mirror()
        if self._staged is not None:  # what the guest wrote since the last pass, allocated while it runs
            with contextlib.suppress(OSError):  # the copy in the pause allocates it, or says why it cannot
                await asyncio.to_thread(self._staged.frozen.mirror)
        started = time.monotonic()  # the pause (capture_seconds) begins
        # the guest opened the agent's port by now if it runs one: no probe, no wait
        agent = backend.guest_agent_open
        log.info("guest agent at capture: %s", "port open" if agent else "none")
        prepared, self._staged = self._staged, None
        try:
            staged = prepared.snap if prepared else self._store.staging(key)  # a full stream's is made now
        except OSError as e:  # before the pause: the guest runs on, uncaptured
            self._not_staged(e)
            return None
        try:
            await backend.save_state(staged.memory)
        except Exception as e:  # paused for the capture
            if prepared is not None:
                prepared.close()
            if not isinstance(e, (HostError, OSError)):  # a bug's: the caller stops the guest (Power._capture)
                await self._store.discard(staged)
                raise
            if isinstance(e, HostError):  # QEMU's refusal: never retried for this key
                self._uncapturable[key] = why = f"QEMU cannot snapshot this guest: {e.message}"
            else:  # its file could not be made (a failing cache volume, out of inodes): the next cold boot tries
                why = (f"the snapshot's state could not be written into {self._store.root} ({e.strerror or e}); "
                       "give the cache volume room for it, or set snapshot: off")
            await self._not_stored(staged, why)  # it runs on, uncaptured
            if backend.alive:
                await backend.resume()
            return None
        if prepared is None:
            return Capture(key, staged, agent, started)
        return Capture(key, staged, agent, started, prepared.ram, prepared.frozen)

    async def commit(self, capture: Capture, consoles: dict[str, bytes]) -> Snapshot | None:
        """With the guest stopped (it is restored from the snapshot next): store the snapshot, its
        disk the boot's overlay, moved in; None when it cannot be stored (recorded)."""
        staged = capture.staged
        try:
            await asyncio.to_thread(shutil.move, self._paths.overlay, staged.disk)
            hashed = {"ram": await asyncio.to_thread(copy_ram, capture.ram, staged.ram)} if capture.ram else {}
            snap = await self._commit(capture, consoles, hashed)
        except HostError as e:
            await self._not_stored(staged, e.message)
            return None
        finally:
            if capture.ram is not None:
                capture.ram.close()
            if capture.frozen is not None:
                capture.frozen.close()
        capture.seconds = round(time.monotonic() - capture.started, 3)
        metrics.snapshot_capture.observe(capture.seconds)
        log.info("memory snapshot %s captured in %.2f s (%d MB)", capture.key, capture.seconds, snap.size >> 20)
        return snap

    async def drop_unfinished(self, capture: Capture) -> None:
        """Remove what ``capture`` staged after a bug's exception broke it past its pause, unless it
        was committed or is being stored (what the store's own failures discard)."""
        if self._storing is not None or not capture.staged.path.exists():
            return
        if capture.frozen is not None:  # (waits for a copy of the RAM still under way in its thread)
            await asyncio.to_thread(capture.frozen.close)
        await self._store.discard(capture.staged)

    def copy_ram_out(self, capture: Capture) -> asyncio.Future[None] | None:
        """Begin copying the paused guest's RAM out of its reach (``FrozenRam.freeze``, in a thread)
        as soon as its state is written, beside the disk's switch to a new overlay; :meth:`freeze`
        waits for it. None for a full-stream capture (its RAM is in the stream)."""
        if capture.frozen is None:
            return None
        return asyncio.ensure_future(asyncio.to_thread(capture.frozen.freeze))

    async def freeze(self, capture: Capture, frozen_disk: Path,
                     ram_copy: asyncio.Future[None] | None) -> FrozenCapture | None:
        """With the guest paused, for a boot that goes on in its process: what the snapshot is made
        of, copied where the guest cannot change it (the RAM into a memfd the kernel then keeps
        read-only, ``ram_copy`` of :meth:`copy_ram_out`, hashed for the seal when it is stored: the
        seal is taken over exactly what the capture wrote, before any lease); None when it cannot be
        (recorded, the guest goes on uncaptured). :meth:`store_in_background` writes it into the
        store after Ready.

        The RAM goes into a second memfd, not the cache's file: writing a file's page cache while
        the kernel writes back the pull's image stalled the pause to 0.3-0.6 s (0.08 s into memory).
        """
        staged, frozen = capture.staged, capture.frozen
        # both awaited whatever either does: the RAM's thread cannot be stopped, and holds ``frozen``
        outcomes = await asyncio.gather(_copy_disk(frozen_disk, staged.disk),
                                        *([ram_copy] if ram_copy is not None else []), return_exceptions=True)
        try:
            for outcome in outcomes:
                if isinstance(outcome, BaseException):
                    raise outcome
        except HostError as e:
            if frozen is not None:
                frozen.close()
            await self._not_stored(staged, e.message)
            return None
        finally:
            if capture.ram is not None:
                if self._live_ram is not None:  # an earlier guest's, never taken: its QEMU is gone by now
                    self._live_ram.close()
                self._live_ram = capture.ram
        capture.seconds = round(time.monotonic() - capture.started, 3)
        metrics.snapshot_capture.observe(capture.seconds)  # the pause is over: known at Ready, as the state says
        self.info = self.info.model_copy(update={"capture_seconds": capture.seconds})
        return FrozenCapture(frozen)

    @staticmethod
    async def abandon_ram_copy(ram_copy: asyncio.Future[None] | None) -> None:
        """Wait for a :meth:`copy_ram_out` whose capture is committed from the stopped guest
        instead (its disk could not be frozen live); what it copied is released with the capture."""
        if ram_copy is not None:
            with contextlib.suppress(HostError):
                await ram_copy

    def store_in_background(self, capture: Capture, frozen: FrozenCapture, consoles: dict[str, bytes]) -> None:
        """Write the frozen capture into the store while the guest runs on (``snapshot.available``
        turns true when it is there); the next boot waits for it (:meth:`stored`)."""
        self._last_stored = None
        self._storing = asyncio.create_task(self._store_frozen(capture, frozen, consoles))

    async def _store_frozen(self, capture: Capture, frozen: FrozenCapture, consoles: dict[str, bytes]) -> None:
        staged, started = capture.staged, time.monotonic()
        try:
            hashed = {}
            if frozen.ram is not None:
                if not frozen.ram.is_sealed():  # what makes a seal taken now the capture's
                    raise HostError("the copy of the snapshot's RAM is not sealed read-only; no snapshot is stored")
                hashed["ram"] = await asyncio.to_thread(copy_ram, frozen.ram.ram, staged.ram)
            snap = await self._commit(capture, consoles, hashed)
        except Exception as e:  # nothing of it reaches the lease's guest, which runs on
            await self._not_stored(staged, _why_not_stored(e))
            return
        finally:
            if frozen.ram is not None:
                frozen.ram.close()
        log.info("memory snapshot %s captured in %.2f s with the guest paused, stored %.2f s later (%d MB)",
                 capture.key, capture.seconds, time.monotonic() - started, snap.size >> 20)
        self._unproven.add(capture.key)
        self._last_stored = snap
        self.captured(capture, snap)

    async def _commit(self, capture: Capture, consoles: dict[str, bytes], hashed: dict) -> Snapshot:
        """The staged files, complete, made the store's snapshot (templated when ``hashed`` has its RAM)."""
        meta = SnapshotMeta(guest_agent=capture.guest_agent, form=TEMPLATED if "ram" in hashed else STREAM)
        return await asyncio.to_thread(self._store.commit, capture.staged, capture.key, consoles, meta, hashed)

    def _not_staged(self, error: OSError) -> None:
        """No capture this boot: its staging directory could not be made (recorded, logged)."""
        self._why(f"no snapshot this boot: it could not be staged in {self._store.root} ({error.strerror or error}); "
                  "make it a directory this user can write on a cache volume with room, or set snapshot: off")
        log.warning("no memory snapshot: %s", self.info.reason)

    async def _not_stored(self, staged: Snapshot, why: str) -> None:
        """A capture that cannot be stored: what it staged goes, the reason is recorded."""
        await self._store.discard(staged)
        self._why(why)
        log.warning("no memory snapshot: %s", why)

    def take_live_ram(self) -> CaptureRam | None:
        """Once the QEMU of a guest that went on after its capture is gone: its RAM, for the caller
        to close (which frees its pages) beside the next boot rather than in its way."""
        ram, self._live_ram = self._live_ram, None
        return ram

    def restore_ram(self, snap: Snapshot) -> RamFile | None:
        """The RAM a restore of ``snap`` maps: a templated snapshot's file, privately (copy-on-write:
        the guest's writes never reach the file every restore maps); None for a full stream."""
        meta = snap.meta()
        return RamFile(snap.ram, share=False) if meta is not None and meta.form == TEMPLATED else None

    async def went_on(self, capture: Capture, agent: GuestAgent | None) -> None:
        """The captured boot goes on in its own process: correct its clock (the snapshot's first
        load is the next restore's)."""
        self.clock_set(await correct_clock(capture.guest_agent, agent))

    def captured(self, capture: Capture, snap: Snapshot) -> None:
        """The captured boot goes on: restored from ``snap`` (it loaded), or in its own process."""
        self.info = self.info.model_copy(update={"available": True, "capture_seconds": capture.seconds,
                                                 "size": snap.size})


async def _copy_disk(frozen: Path, dest: Path) -> None:
    """:raise HostError: naming why the copy failed (e.g. a full cache volume), and the fix."""
    try:
        await asyncio.to_thread(shutil.copyfile, frozen, dest)
    except OSError as e:
        raise HostError(f"the snapshot's disk could not be written into {dest.parent.parent} ({e.strerror or e}); "
                        "give the cache volume room for it, or set snapshot: off") from e


def _why_not_stored(error: Exception) -> str:
    """The reason a capture written beside its running guest is not in the store; a bug's exception
    (none raised on purpose) is named as one, its traceback logged."""
    if isinstance(error, HostError):
        return error.message
    if isinstance(error, OSError):
        return f"the snapshot could not be stored ({error})"
    return f"{unexpected(error, 'store of the snapshot')}; the next cold boot captures again"

"""Leases without boots: capture a pristine guest at its first Ready, restore it afterwards.

A mixin of ``VmController`` (like ``DiskOperations``): capture and restore are steps of its power
operations, under the same lock. The rules:

- **Restore** when a boot starts on a fresh overlay of the spec's own image (a cold start or a
  recycle, not a flashed disk, not a power cycle within a lease) and the cache has the snapshot
  for this spec, image, QEMU and accelerator. A refused snapshot is discarded: the guest boots cold.
- **Capture** at the first Ready of such a cold boot, unless a lease has already claimed the
  guest (its activity must never reach the snapshot; the exporter claims when it hands a lease
  out, so no capture starts after that, and a claim waits for one already under way). The guest is paused, its state written,
  QEMU stopped, the overlay frozen into the snapshot; then the same boot continues from the
  snapshot just taken, which proves it loads. Consoles keep their clients and scrollback.
- **Clock**: a restored guest's wall clock resumes at the capture instant. The capture asks
  whether a guest agent answers (bounded) and records it with the snapshot; every restore of a
  snapshot with an agent sets the guest's clock to the host's through it before Ready.
"""

from __future__ import annotations

import asyncio
import logging
import shutil
import time
from typing import Any

from vmsidecar_contract.errors import HostError, ImageError, VmsidecarError
from vmsidecar_contract.spec import VmSpec
from vmsidecar_contract.state import Phase, SnapshotInfo

from ..backend import Backend, guest_agent
from ..backend.common import TCG_CPU
from ..disk import DiskImage
from ..plan import BootPlan
from ..snapshots import CONSOLES, Snapshot, SnapshotMeta, SnapshotStore, snapshot_key
from .disks import Disks
from .paths import RuntimePaths
from .readiness import effective_readiness
from .streams import GuestStreams

log = logging.getLogger(__name__)

#: how long the capture waits for a guest agent to answer (once per snapshot; an agent that is
#: up answers in ~0.1 s, so only a guest without one pays all of it, on its first Ready)
AGENT_PROBE_S = 3.0
#: bound on reaching the agent after a restore (it answers a sync in ~10 ms when it is there)
CLOCK_TIMEOUT_S = 5.0
#: how long Ready waits for guest-set-time's answer: the clock is set when the agent reads the
#: command; the answer waits for ``hwclock -w`` (up to ~2.6 s under TCG), which Ready need not
CLOCK_ANSWER_WAIT_S = 0.3
CLOCK_CORRECTED = "corrected"
CLOCK_NO_AGENT = "no guest agent"


class SnapshotOperations:
    """Decides when to restore or capture, and does it."""

    # provided by VmController
    disks: Disks
    streams: GuestStreams
    paths: RuntimePaths
    phase: Phase
    _backend: Backend | None
    _plan: BootPlan | None
    _claimed: bool
    _lock: asyncio.Lock

    def _spawn(self, coro: Any) -> None: ...
    def _set_ready(self) -> None: ...
    async def _launch_restored(self, snap: Snapshot, *, new_boot: bool = True) -> None: ...
    async def _cold_boot(self) -> None: ...
    async def _quiet_stop(self) -> None: ...

    def _init_snapshots(self) -> None:
        self._store = SnapshotStore(self.paths.cache)
        self.snapshot_info = SnapshotInfo()
        #: key of the snapshot the current cold boot should capture at its first Ready
        self._capture_key: str | None = None
        #: key of the snapshot the current boot restores or captures
        self._planned_key: str | None = None
        #: keys QEMU could not snapshot (a device that blocks migration): not retried
        self._uncapturable: dict[str, str] = {}
        #: set while a capture runs (it started before any lease had the guest); a claim waits for it
        self._capturing: asyncio.Event | None = None

    async def _capture_finished(self) -> None:
        """Return once no capture is under way (a claim waits: the lease must not act during one)."""
        while self._capturing is not None:
            await self._capturing.wait()

    def _snapshot_key(self, spec: VmSpec, accel: str) -> str | None:
        """The key for booting ``spec`` on the spec's own image now, or None (reason recorded)."""
        base = self.disks.current
        reason = None
        if spec.snapshot == "off":
            reason = "snapshot: off in the spec"
        elif spec.backend != "qemu":
            reason = "the libvirt backend has no memory snapshots yet"
        elif spec.arch != "x86_64":  # only x86_64 gets a vmgenid (backend/qemu_argv.py): decisions.md
            reason = f"{spec.arch}: no vmgenid, the guest's RNG would repeat — cold boot"
        elif self.disks.flashed is not None or base is None:
            reason = "the disk was flashed in this lease"
        elif self.paths.overlay.exists():
            reason = "the disk already has this lease's changes (power cycle within a lease)"
        if reason is not None:
            self.snapshot_info = self.snapshot_info.model_copy(update={"reason": reason})
            return None
        assert base is not None
        cpu = "host" if accel == "kvm" else TCG_CPU[spec.arch]
        try:  # the image's annotations may set the readiness, i.e. the instant a snapshot is taken
            readiness = effective_readiness(spec, base).readiness
        except ImageError as e:  # the boot fails at its readiness watch, with this reason
            self.snapshot_info = self.snapshot_info.model_copy(update={"reason": e.message})
            return None
        return snapshot_key(spec, base.digest, accel, cpu, readiness)

    def _plan_snapshot(self, spec: VmSpec, accel: str) -> Snapshot | None:
        """Before a boot: the snapshot to restore, or None (and whether to capture one)."""
        self._capture_key = None
        self.snapshot_info = self.snapshot_info.model_copy(update={"clock": None})
        key = self._snapshot_key(spec, accel)
        self._planned_key = key
        snap = self._store.find(key) if key is not None else None
        self._store.hold([self.disks.base, self.disks.current], snap)  # never evicted while in use
        if key is None:
            return None
        self.snapshot_info = self.snapshot_info.model_copy(
            update={"available": snap is not None, "size": snap.size if snap else None})
        if snap is not None:
            return snap
        if key in self._uncapturable:
            self.snapshot_info = self.snapshot_info.model_copy(update={"reason": self._uncapturable[key]})
        else:
            self._capture_key = key
            self.snapshot_info = self.snapshot_info.model_copy(
                update={"reason": "no snapshot yet for this spec and image: this boot captures one at Ready"})
        return None

    def _overlay_backing(self, snap: Snapshot) -> DiskImage:
        base = self.disks.current
        assert base is not None
        return DiskImage(snap.disk, "qcow2", base.digest, base.source)

    async def _restore_or_fall_back(self, snap: Snapshot, *, new_boot: bool = True) -> bool:
        """Run from ``snap`` (a new boot, or the captured boot continuing); on refusal discard it
        and return False (the caller boots cold)."""
        started = time.monotonic()
        assert self.disks.current is not None
        broken = await asyncio.to_thread(self._store.verify, snap, self.disks.current)
        if broken is not None:  # never handed to QEMU
            log.warning("memory snapshot %s not restored: %s; removing it and booting cold", snap.path.name, broken)
            await self._store.discard(snap)
            self.snapshot_info = SnapshotInfo(boot="cold", reason=f"the snapshot failed its seal check: {broken}; "
                                              "it was removed and a new one is captured at Ready")
            self._capture_key = self._planned_key
            return False
        try:
            await self._launch_restored(snap, new_boot=new_boot)
        except VmsidecarError as e:
            log.warning("memory snapshot %s refused (%s); booting cold", snap.path.name, e.message)
            await self._quiet_stop()
            self.paths.overlay.unlink(missing_ok=True)
            await self._store.discard(snap)
            self.snapshot_info = SnapshotInfo(boot="cold", reason=f"the snapshot was refused ({e.message}); "
                                              "it was discarded and a new one is captured at Ready")
            self._capture_key = self._planned_key  # the cold boot that follows takes a new one
            return False
        update: dict[str, Any] = {"available": True, "restore_seconds": round(time.monotonic() - started, 3)}
        update["clock"] = await self._correct_clock(snap)
        if new_boot:
            update |= {"boot": "restored", "reason": None}
        self.snapshot_info = self.snapshot_info.model_copy(update=update)
        return True

    async def _correct_clock(self, snap: Snapshot) -> str:
        """Set the restored guest's clock to the host's when the capture found an agent."""
        meta = snap.meta()
        if meta is None or not meta.guest_agent:
            return CLOCK_NO_AGENT
        assert self._plan is not None
        started = time.monotonic()
        try:
            answered = await guest_agent.set_time(self._plan.guest_agent_socket, CLOCK_TIMEOUT_S,
                                                  CLOCK_ANSWER_WAIT_S)
        except guest_agent.GuestAgentError as e:
            log.warning("the restored guest's clock was not corrected: %s", e.message)
            return f"failed: {e.message}"
        log.info("restored guest's clock set to the host's in %.2f s%s", time.monotonic() - started,
                 "" if answered else " (the agent is still writing the RTC)")
        return CLOCK_CORRECTED

    def _ready_or_capture(self) -> bool:
        """At a boot's Ready: True when a capture was started (it marks Ready itself)."""
        if self._capture_key is None:
            return False
        key, self._capture_key = self._capture_key, None
        if self._claimed:
            self._capture_abandoned()
            return False
        self._spawn(self._capture(key))
        return True

    def _capture_abandoned(self) -> None:
        self.snapshot_info = self.snapshot_info.model_copy(update={
            "reason": "a lease was handed out before this boot was Ready, so it is not captured (the lease may "
                      "have changed the guest); the next pristine boot, after the lease's recycle, captures it"})

    async def _capture(self, key: str) -> None:
        async with self._lock:
            backend = self._backend
            if backend is None or self.phase != Phase.RUNNING:
                return  # powered off or failed while waiting for the lock
            if self._claimed:
                self._capture_abandoned()
                self._set_ready()
                return
            self._capturing = asyncio.Event()
            try:
                await self._capture_locked(key, backend)
            finally:
                self._capturing.set()
                self._capturing = None

    async def _capture_locked(self, key: str, backend: Backend) -> None:
        started = time.monotonic()
        plan = self._plan
        assert plan is not None
        # asked before the state is saved: the agent's answer is in no later restore's channel
        agent = await guest_agent.probe(plan.guest_agent_socket, AGENT_PROBE_S)
        log.info("guest agent at capture: %s (%.2f s)", "answers" if agent else "none", time.monotonic() - started)
        staged = self._store.staging(key)
        try:
            await backend.save_state(staged.memory)
        except HostError as e:
            await self._store.discard(staged)
            self._uncapturable[key] = f"QEMU cannot snapshot this guest: {e.message}"
            self.snapshot_info = self.snapshot_info.model_copy(update={"reason": self._uncapturable[key]})
            log.warning("no memory snapshot: %s", e.message)
            if backend.alive:
                await backend.resume()
            self._set_ready()
            return
        consoles = {name: self.streams.hubs[name].boot_output() for name in CONSOLES if name in self.streams.hubs}
        await self._quiet_stop()
        await asyncio.to_thread(shutil.move, self.paths.overlay, staged.disk)
        try:
            snap = await asyncio.to_thread(self._store.commit, staged, key, consoles,
                                           SnapshotMeta(guest_agent=agent))
        except HostError as e:
            await self._store.discard(staged)
            self.snapshot_info = self.snapshot_info.model_copy(update={"reason": e.message})
            log.warning("no memory snapshot: %s", e.message)
            await self._cold_boot()
            return
        captured = round(time.monotonic() - started, 3)
        log.info("memory snapshot %s captured in %.2f s (%d MB)", key, captured, snap.size >> 20)
        if await self._restore_or_fall_back(snap, new_boot=False):
            self.snapshot_info = self.snapshot_info.model_copy(
                update={"capture_seconds": captured, "size": snap.size})
            self._set_ready()
        else:
            await self._cold_boot()

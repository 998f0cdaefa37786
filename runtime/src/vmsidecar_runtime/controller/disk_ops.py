"""The disk operations of the controller: pull, flash (streamed or by reference) and dump.

A mixin of ``VmController`` rather than a separate object because each operation is one of the
controller's public calls: it takes the same power lock and checks the same phase as power and
recycle do. The files themselves are ``Disks``' job.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterable
from pathlib import Path
from typing import Any

from vmsidecar_contract.errors import VmsidecarError
from vmsidecar_contract.state import BOOTABLE, LIVE, Phase, Timings, VmState, require

from ..disk import DiskImage
from ..events import EventBus
from ..hostpaths import HostPathPolicy
from .disks import Disks, Progress


class DiskOperations:
    """Pull, flash and dump, serialized with power operations."""

    # provided by VmController
    disks: Disks
    events: EventBus
    host_paths: HostPathPolicy
    phase: Phase
    _lock: asyncio.Lock
    _timings: Timings

    def _require_spec(self) -> Any: ...
    def _set_phase(self, phase: Phase, **data: Any) -> None: ...
    def _fail(self, phase: Phase, error: VmsidecarError) -> None: ...
    def state(self) -> VmState: ...
    async def _stop_backend(self, *, graceful: bool, timeout: float = 60.0) -> None: ...

    # ---- images --------------------------------------------------------------------------
    async def pull(self, reference: str | None = None, *, progress: Progress | None = None) -> DiskImage:
        """Pull an image into the cache (or reuse it) and return it as a base disk.

        :raise ImageError: for every pull failure, with the cause and the fix.
        """
        disk, pulled, seconds = await self.disks.pull(self._require_spec(), reference, progress=progress)
        self._timings = self._timings.model_copy(update={"pull": round(seconds, 3)})
        self.events.publish("pulled", reference=disk.source, digest=pulled.digest, cached=pulled.cached,
                            bytes_downloaded=pulled.bytes_downloaded)
        return disk

    async def _ensure_disk(self) -> DiskImage:
        if self.disks.current is None:
            previous = self.phase
            self._set_phase(Phase.PULLING)
            try:
                self.disks.base = await self.pull()
            except VmsidecarError as e:
                self._fail(Phase.ERROR, e)
                raise
            self._set_phase(previous if previous != Phase.PULLING else Phase.STOPPED)
        assert self.disks.current is not None
        return self.disks.current

    # ---- flash and dump ------------------------------------------------------------------
    async def flash(self, chunks: AsyncIterable[bytes], *, power_off: bool = False, expected_size: int | None = None,
                    expected_digest: str | None = None) -> VmState:
        """Replace the disk with a streamed image (atomic; the old disk stays on any failure).

        :raise StateError: while the VM runs and ``power_off`` is not set.
        :raise ImageError: for a bad image.
        """
        async with self._lock:
            self._require_off_or(power_off)
            received = await self.disks.receive_flash(chunks, expected_size=expected_size,
                                                      expected_digest=expected_digest)
            await self._stop_for_flash()
            self.disks.use_flashed(received)
            self.events.publish("flashed", digest=received.digest, size=received.size, format=received.format)
            return self.state()

    async def flash_reference(self, reference: str, *, power_off: bool = False,
                              progress: Progress | None = None) -> VmState:
        """Pull an image by reference (an API call: host paths only where allowed) and make it the
        disk (the cache keeps it read-only).

        :raise HostPathError: for a ``file:``/``oci-layout:`` reference the administrator did not allow.
        :raise StateError: while the VM runs (also when it was powered on during the pull) and
            ``power_off`` is not set.
        """
        self.host_paths.check_reference(reference)
        self._require_off_or(power_off)
        disk = await self.pull(reference, progress=progress)
        async with self._lock:
            self._require_off_or(power_off)  # it may have been powered on during the pull
            await self._stop_for_flash()
            self.disks.use_pulled(disk)
            self.events.publish("flashed", digest=disk.digest, reference=reference)
            return self.state()

    def _require_off_or(self, power_off: bool) -> None:
        if self.phase in LIVE and not power_off:
            require(self.phase, BOOTABLE, "flash the disk", hint="or send power_off=true to power it off first")

    async def _stop_for_flash(self) -> None:
        if self.phase in LIVE or self.phase == Phase.ERROR:
            await self._stop_backend(graceful=False)
            self._set_phase(Phase.STOPPED, reason="flash")

    async def dump(self, fmt: str = "qcow2") -> Path:
        """Write the current disk (base + this lease's changes) to a new standalone image file,
        which the caller deletes.

        :raise StateError: while the guest runs (its writes would make the copy inconsistent).
        """
        async with self._lock:
            require(self.phase, BOOTABLE, "dump the disk (power it off first)")
            await self._ensure_disk()
            return await self.disks.dump(fmt)


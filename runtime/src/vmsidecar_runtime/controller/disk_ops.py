"""The disk operations: flash (streamed, or pulled by reference) and dump, under the power lock.

Each is one of the controller's calls and takes the same lock and checks the same phase as power
and recycle do; a flash powers the guest off first only when asked (``power_off``). The bytes move
through ``Transfers`` (one transfer per VM, owned by its generation, within the pull deadline); the
files are ``Disks``'. A flash by reference is two calls, so that a caller streaming its progress can
answer every refusal before it starts: ``reserve_flash`` (checks, then the transfer reserved) and
``flash_reference`` (the pull with a progress callback, then the install).
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterable, AsyncIterator, Callable
from pathlib import Path

from vmsidecar_contract.spec import VmSpec
from vmsidecar_contract.state import BOOTABLE, LIVE, Phase

from .. import metrics
from ..audit import redact
from ..events import EventBus
from ..hostpaths import HostPathPolicy
from .disks import Disks, Progress
from .ledger import LeaseLedger
from .phase import PhaseMachine, require_spec
from .power import Power
from .transfers import Transfer, Transfers


class DiskOps:
    """Flash and dump, serialized with the power operations."""

    def __init__(self, phases: PhaseMachine, events: EventBus, disks: Disks, transfers: Transfers, power: Power,
                 host_paths: HostPathPolicy, ledger: Callable[[], LeaseLedger]) -> None:
        #: the current lease's ledger (a new one every generation)
        self._ledger = ledger
        self._phases = phases
        self._events = events
        self._disks = disks
        self._transfers = transfers
        self._power = power
        self._host_paths = host_paths

    async def flash(self, chunks: AsyncIterable[bytes], *, power_off: bool, expected_size: int | None,
                    expected_digest: str | None) -> None:
        """Replace the disk with a streamed image (atomic; the old disk stays on any failure).

        :raise StateError: while the VM runs and ``power_off`` is not set.
        :raise ImageError: for a bad image. :raise TransferError, PullTimeoutError: as ``Transfers``.
        """
        transfer = self._transfers.begin("an upload flash")
        started = time.monotonic()

        async def counted() -> AsyncIterator[bytes]:  # bytes in, as sent (compressed or not)
            async for chunk in chunks:
                transfer.received += len(chunk)
                yield chunk

        try:
            async with self._phases.lock:
                self._transfers.check(transfer)
                self._require_off_or(power_off)
                received = await self._transfers.receive(counted(), transfer, expected_size=expected_size,
                                                         expected_digest=expected_digest)
                await self._stop_for_flash()
                self._disks.use_flashed(received)
                self._events.publish("flashed", digest=received.digest, size=received.size, format=received.format)
                self._flashed("upload", f"upload@{received.digest}", transfer.received, started)
        finally:
            self._transfers.end(transfer)

    def reserve_flash(self, reference: str, *, power_off: bool) -> Transfer:
        """Refuse a flash from ``reference`` that cannot start, else reserve its transfer (the
        caller hands it to ``flash_reference``, which ends it).

        :raise HostPathError: a ``file:``/``oci-layout:`` reference the administrator did not allow.
        :raise StateError: the VM runs and ``power_off`` is not set.
        :raise TransferError: another transfer is under way (transfer_in_progress).
        """
        self._host_paths.check_reference(reference)
        self._require_off_or(power_off)
        # redacted: what a transfer is called reaches the next lease (a 409, transfer_cancelled)
        return self._transfers.begin(f"the flash from {redact(reference)}")

    async def flash_reference(self, spec: VmSpec | None, reference: str, *, power_off: bool,
                              progress: Progress | None, transfer: Transfer | None) -> None:
        """Pull an image by reference (``progress`` hears every chunk) and make it the disk (the
        cache keeps it read-only). ``transfer``: reserved by ``reserve_flash``; else reserved here.
        Either way it ends here.

        :raise HostPathError, StateError, TransferError: as ``reserve_flash``; also StateError when
            the VM was powered on during the pull, TransferError (transfer_cancelled) when the
            transfer was cancelled meanwhile. :raise PullTimeoutError: past the pull deadline.
        """
        started = time.monotonic()
        try:
            if transfer is None:
                transfer = self.reserve_flash(reference, power_off=power_off)
            else:  # checked again: the VM may have been powered on since the reservation
                self._host_paths.check_reference(reference)
                self._require_off_or(power_off)
            disk = await self._power.pull(require_spec(spec), reference, progress=progress, transfer=transfer)
            async with self._phases.lock:
                self._transfers.check(transfer)  # the lease it belonged to may have ended meanwhile
                self._require_off_or(power_off)  # it may have been powered on during the pull
                await self._stop_for_flash()
                self._disks.use_pulled(disk)
                self._events.publish("flashed", digest=disk.digest, reference=reference)
                self._flashed(metrics.source_of(reference), f"{redact(reference)}@{disk.digest}", transfer.received,
                              started)
        finally:
            if transfer is not None:
                self._transfers.end(transfer)

    def _flashed(self, source: metrics.Source, target: str, nbytes: int, started: float) -> None:
        metrics.flash_bytes.labels(source).inc(nbytes)
        metrics.flash_seconds.labels(source).observe(time.monotonic() - started)
        self._ledger().flash(target, nbytes)

    def _require_off_or(self, power_off: bool) -> None:
        if self._phases.phase in LIVE and not power_off:
            self._phases.require(BOOTABLE, "flash the disk", hint="or send power_off=true to power it off first")

    async def _stop_for_flash(self) -> None:
        if self._phases.phase in LIVE or self._phases.phase == Phase.ERROR:
            await self._power.stop(graceful=False)
            self._phases.set(Phase.STOPPED, reason="flash")

    async def dump(self, spec: VmSpec | None, fmt: str, transfer: Transfer | None = None) -> Path:
        """Write the current disk (base + this lease's changes) to a new standalone image file,
        which the caller deletes. ``transfer``: the dump's (the API's); its cancel (the lease's end)
        stops the conversion.

        :raise StateError: while the guest runs (its writes would make the copy inconsistent).
        :raise TransferError: ``transfer`` was cancelled (nothing is left of the copy).
        """
        async with self._phases.lock:
            self._phases.require(BOOTABLE, "dump the disk (power it off first)")
            await self._power.ensure_disk(spec)
            if transfer is None:
                path = await self._disks.dump(fmt)
            else:
                path = await self._transfers.dump(fmt, transfer)
            size = path.stat().st_size
            metrics.dump_bytes.inc(size)
            self._ledger().dump(size)
            return path

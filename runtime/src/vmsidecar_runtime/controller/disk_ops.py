"""The disk operations of the controller: pull, flash (streamed or by reference) and dump.

A mixin of ``VmController`` rather than a separate object because each operation is one of the
controller's public calls: it takes the same power lock and checks the same phase as power and
recycle do. The files themselves are ``Disks``' job.

A disk transfer (a flash by reference, an upload flash) belongs to the lease it started in: one at
a time per VM (a second is a 409), bounded by the runtime's pull deadline, cancelled when its
lease ends (recycle), when the next lease claims the VM or when its client goes away, and never
installed once cancelled or once the generation it started in is gone. A pull runs in a worker
thread that cannot be interrupted from outside: it is told to stop (``Transfer.abort``) and does at
its next chunk, removing its partial file.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import AsyncIterable, Awaitable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from vmsidecar_contract.errors import PullTimeoutError, TransferError, VmsidecarError
from vmsidecar_contract.state import BOOTABLE, LIVE, Phase, Timings, VmState, require

from ..disk import DiskImage
from ..events import EventBus
from ..hostpaths import HostPathPolicy
from .disks import Disks, Progress

log = logging.getLogger(__name__)
T = TypeVar("T")

#: default deadline of one pull or upload flash, start to end (serve --pull-timeout): a registry
#: that trickles must not hold a VM (and a lease's recycle) for ever
DEFAULT_PULL_TIMEOUT_S = 1800.0


class _Abandoned(BaseException):
    """Raised in a pull's worker thread at its next chunk once the pull was given up. A
    BaseException, so no ``except Exception`` on the way turns it into an image error; the pull's
    own clean-up (``except BaseException``) removes the partial file."""


@dataclass(eq=False)
class Transfer:
    """One disk transfer of a lease: what it is, the generation it belongs to, how to stop it."""

    what: str
    generation: int
    #: set when the transfer is given up: the pull's worker thread stops at its next chunk
    abort: threading.Event = field(default_factory=threading.Event)
    #: why it was cancelled (None while it may still be installed)
    reason: str | None = None
    cancelled: asyncio.Event = field(default_factory=asyncio.Event)

    def cancel(self, reason: str) -> None:
        if self.reason is None:
            self.reason = reason
        self.abort.set()
        self.cancelled.set()


class DiskOperations:
    """Pull, flash and dump, serialized with power operations."""

    # provided by VmController
    disks: Disks
    events: EventBus
    host_paths: HostPathPolicy
    phase: Phase
    _lock: asyncio.Lock
    _timings: Timings
    #: seconds one pull or upload flash may take (serve --pull-timeout)
    pull_timeout: float
    _transfer: Transfer | None

    @property
    def generation(self) -> int: ...
    def _require_spec(self) -> Any: ...
    def _set_phase(self, phase: Phase, **data: Any) -> None: ...
    def _fail(self, phase: Phase, error: VmsidecarError) -> None: ...
    def state(self) -> VmState: ...
    async def _stop_backend(self, *, graceful: bool, timeout: float = 60.0) -> None: ...

    # ---- transfers -----------------------------------------------------------------------
    def begin_transfer(self, what: str) -> Transfer:
        """Reserve the VM's one disk transfer for the current generation (the caller ends it).

        :raise TransferError: while another transfer is under way (409 transfer_in_progress).
        """
        current = self._transfer
        if current is not None:
            raise TransferError(
                f"{current.what} is still under way on this VM, and a VM takes one disk transfer at a time; "
                "wait for it to end (or end the lease, which cancels it), then flash again")
        self._transfer = Transfer(what, self.generation)
        return self._transfer

    def end_transfer(self, transfer: Transfer) -> None:
        if self._transfer is transfer:
            self._transfer = None

    def cancel_transfer(self, reason: str, transfer: Transfer | None = None) -> None:
        """Give up the transfer under way (only ``transfer``, when named): nothing of it is installed.
        The slot is free at once; the transfer's own call ends with ``transfer_cancelled``."""
        current = self._transfer
        if current is None or (transfer is not None and current is not transfer):
            return
        self._transfer = None
        current.cancel(reason)
        log.warning("%s cancelled: %s", current.what, reason)
        self.events.publish("transfer_cancelled", what=current.what, generation=current.generation, reason=reason)

    def _check_transfer(self, transfer: Transfer) -> None:
        """Before installing: a cancelled transfer, or one of a generation since recycled, is thrown away."""
        if transfer.reason is None and transfer.generation != self.generation:
            transfer.cancel(f"the lease it belonged to ended (generation {transfer.generation} was recycled)")
        if transfer.reason is not None:
            raise TransferError(f"{transfer.what} was cancelled: {transfer.reason}; nothing of it was installed",
                                code="transfer_cancelled")

    async def _bounded(self, work: Awaitable[T], what: str, transfer: Transfer | None, abort: threading.Event) -> T:
        """Await ``work`` within the pull deadline, unless ``transfer`` is cancelled first.

        :raise PullTimeoutError: past the deadline; :raise TransferError: cancelled.
        """
        task = asyncio.ensure_future(work)
        waiters: set[asyncio.Future[Any]] = {task}
        stop = asyncio.ensure_future(transfer.cancelled.wait()) if transfer is not None else None
        if stop is not None:
            waiters.add(stop)
        try:
            done, _ = await asyncio.wait(waiters, timeout=self.pull_timeout, return_when=asyncio.FIRST_COMPLETED)
        finally:
            if stop is not None:
                stop.cancel()
            if not task.done():
                abort.set()  # a worker thread stops at its next chunk
                task.cancel()
                await asyncio.wait({task})  # its clean-up (partial files) runs before the answer
        if transfer is not None and transfer.reason is not None:
            if task.done() and not task.cancelled():
                task.exception()  # retrieved: it is thrown away with the transfer
            self._check_transfer(transfer)
        if task in done:
            return task.result()
        raise PullTimeoutError(
            f"{what} did not finish within {self.pull_timeout:g} s, the runtime's deadline for one pull; nothing "
            "was installed; use a closer or faster registry (or send the image faster), or raise the deadline "
            "with vmsidecar-runtime serve --pull-timeout SECONDS (VMSIDECAR_PULL_TIMEOUT)")

    # ---- images --------------------------------------------------------------------------
    async def pull(self, reference: str | None = None, *, progress: Progress | None = None,
                   transfer: Transfer | None = None) -> DiskImage:
        """Pull an image into the cache (or reuse it) and return it as a base disk, within the pull
        deadline and unless ``transfer`` is cancelled first.

        :raise ImageError: for every pull failure, with the cause and the fix.
        :raise PullTimeoutError: past the deadline. :raise TransferError: ``transfer`` was cancelled.
        """
        spec = self._require_spec()
        abort = transfer.abort if transfer is not None else threading.Event()

        def report(done: int, total: int | None) -> None:  # the worker thread, at every chunk
            if abort.is_set():
                raise _Abandoned
            if progress is not None:
                progress(done, total)

        what = f"the pull of {reference or spec.image}"
        disk, pulled, seconds = await self._bounded(self.disks.pull(spec, reference, progress=report), what,
                                                    transfer, abort)
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
        transfer = self.begin_transfer("an upload flash")
        try:
            async with self._lock:
                self._check_transfer(transfer)
                self._require_off_or(power_off)
                received = await self._bounded(
                    self.disks.receive_flash(chunks, expected_size=expected_size, expected_digest=expected_digest),
                    "the upload flash", transfer, transfer.abort)
                self._check_transfer(transfer)
                await self._stop_for_flash()
                self.disks.use_flashed(received)
                self.events.publish("flashed", digest=received.digest, size=received.size, format=received.format)
                return self.state()
        finally:
            self.end_transfer(transfer)

    async def flash_reference(self, reference: str, *, power_off: bool = False, progress: Progress | None = None,
                              transfer: Transfer | None = None) -> VmState:
        """Pull an image by reference (an API call: host paths only where allowed) and make it the
        disk (the cache keeps it read-only). ``transfer``: reserved by the caller (``begin_transfer``),
        ended here; else reserved here.

        :raise HostPathError: for a ``file:``/``oci-layout:`` reference the administrator did not allow.
        :raise StateError: while the VM runs (also when it was powered on during the pull) and
            ``power_off`` is not set.
        :raise TransferError: another transfer is under way (transfer_in_progress), or this one was
            cancelled (transfer_cancelled). :raise PullTimeoutError: past the pull deadline.
        """
        try:
            self.host_paths.check_reference(reference)
            self._require_off_or(power_off)
            transfer = transfer or self.begin_transfer(f"the flash from {reference}")
            disk = await self.pull(reference, progress=progress, transfer=transfer)
            async with self._lock:
                self._check_transfer(transfer)  # the lease it belonged to may have ended meanwhile
                self._require_off_or(power_off)  # it may have been powered on during the pull
                await self._stop_for_flash()
                self.disks.use_pulled(disk)
                self.events.publish("flashed", digest=disk.digest, reference=reference)
                return self.state()
        finally:
            if transfer is not None:
                self.end_transfer(transfer)

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

